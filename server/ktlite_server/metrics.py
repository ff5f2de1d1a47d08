"""A pod's Prometheus metrics: ``GET /metrics``, behind the deployment token like every
route but ``/health``.

Counted on the call path with plain integers (the pod server is one event loop: no lock, no
library call per call) and turned into metric families by ``prometheus_client`` only when
scraped, which renders the exposition format:

- ``ktlite_calls_total``: calls this pod has taken since it started (an adapter's
  ``rate()`` of it is ``ktlite_calls_per_second``, what ``autoscale(metric="rps")`` scales on);
- ``ktlite_calls_finished_total{outcome}``: calls this pod finished, by their worst rank
  outcome (``ok``, ``error``, ``died``, ``cancelled``, ``timeout``);
- ``ktlite_call_duration_seconds``: a histogram of those calls' time on this pod, from their
  arrival to their last rank's outcome;
- ``ktlite_inflight_calls``: calls running now (what an HPA on ``metric="concurrency"``
  scales on);
- ``ktlite_call_received_bytes_total`` / ``ktlite_call_sent_bytes_total``: call arguments in,
  rank results out;
- per rank (``rank`` label): ``ktlite_rank_restarts`` (since its last fresh start),
  ``ktlite_rank_cpu_percent``, ``ktlite_rank_rss_bytes``, and where NVML reports them
  ``ktlite_rank_gpu_memory_bytes`` (its process's), ``ktlite_rank_gpu_memory_used_bytes`` and
  ``ktlite_rank_gpu_utilization_percent`` (its GPUs'), from the same sample as ``ktlite status``.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ktlite_wire.status import Status

# seconds: from a warm no-op call (~1 ms) to an hour-long training call
BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BUCKETS += (2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_WORST = (Status.DIED, Status.ERROR, Status.TIMEOUT, Status.CANCELLED)
_OK, _ERROR = Status.OK, Status.ERROR


class CallMetrics:
    """What the calls of one pod did, since its server started."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last: above the largest bound
        self.seconds = 0.0
        self.received = 0
        self.sent = 0

    def ended(self, outcomes: list[Any], seconds: float, payload: Any, path: str | None) -> None:
        """One call's end: its outcomes (this pod's ranks'), how long it took here, and its
        argument (a buffer, or the shared-memory file ``path`` it landed in)."""
        # the worst status: a set of them hashed each member (Enum's __hash__, a Python call)
        bad = [o.status for o in outcomes if o.status is not _OK] if outcomes else [_ERROR]
        worst = next((s for s in _WORST if s in bad), _OK) if bad else _OK
        self.outcomes[worst.value] += 1
        self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.seconds += seconds
        if path is not None:
            with contextlib.suppress(OSError):  # already gone: a stopped call's
                self.received += os.stat(path).st_size
        else:
            self.received += _nbytes(payload)
        sent = 0
        for o in outcomes:
            data = o.data
            if o.path is not None:
                sent += o.size
            elif data is not None:  # (usually a view of the bytes its rank sent)
                sent += data.nbytes if type(data) is memoryview else _nbytes(data)
        self.sent += sent


def _nbytes(data: Any) -> int:
    if data is None:
        return 0
    try:
        return memoryview(data).nbytes
    except TypeError:
        return 0


def render(
    calls: CallMetrics, taken: int, inflight: int, ranks: list[dict[str, Any]]
) -> tuple[bytes, str]:
    """The exposition text and its content type; ``taken``: calls taken since the start;
    ``ranks``: ``Pod.status()``'s rank rows."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(calls, taken, inflight, ranks))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(
        self, calls: CallMetrics, taken: int, inflight: int, ranks: list[dict[str, Any]]
    ) -> None:
        self.calls, self.taken, self.inflight, self.ranks = calls, taken, inflight, ranks

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        calls = self.calls
        yield CounterMetricFamily(
            "ktlite_calls", "Calls this pod has taken since it started.", value=self.taken
        )
        done = CounterMetricFamily(
            "ktlite_calls_finished", "Calls this pod finished, by outcome.", labels=["outcome"]
        )
        for status in (Status.OK, *_WORST):
            done.add_metric([status.value], calls.outcomes.get(status.value, 0))
        yield done
        running, cumulative = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), calls.buckets, strict=True):
            cumulative += n
            running.append((_le(bound), cumulative))
        yield HistogramMetricFamily(
            "ktlite_call_duration_seconds",
            "Time of the calls this pod finished, from arrival to the last rank's outcome.",
            buckets=running,
            sum_value=calls.seconds,
        )
        yield GaugeMetricFamily(
            "ktlite_inflight_calls", "Calls running on this pod now.", value=self.inflight
        )
        yield CounterMetricFamily(
            "ktlite_call_received_bytes", "Call arguments received.", value=calls.received
        )
        yield CounterMetricFamily("ktlite_call_sent_bytes", "Rank results sent.", value=calls.sent)
        for name, key, what in _RANK_GAUGES:
            family = GaugeMetricFamily(name, what, labels=["rank"])
            for row in self.ranks:
                value = _field(row, key)
                if value is not None:
                    family.add_metric([str(row.get("rank"))], float(value))
            yield family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _field(row: dict[str, Any], key: str) -> Any:
    value = row.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_RANK_GAUGES = (
    ("ktlite_rank_restarts", "restarts", "Restarts of the rank's process since its fresh start."),
    ("ktlite_rank_cpu_percent", "cpu_percent", "The rank process's CPU use, percent of a core."),
    ("ktlite_rank_rss_bytes", "rss_bytes", "The rank process's resident memory."),
    (
        "ktlite_rank_gpu_memory_bytes",
        "gpu_process_memory_bytes",
        "GPU memory the rank process holds (NVML).",
    ),
    (
        "ktlite_rank_gpu_memory_used_bytes",
        "gpu_memory_used_bytes",
        "GPU memory in use on the rank's GPUs, by any process (NVML).",
    ),
    (
        "ktlite_rank_gpu_utilization_percent",
        "gpu_utilization_percent",
        "The utilization of the rank's GPUs (NVML).",
    ),
)
