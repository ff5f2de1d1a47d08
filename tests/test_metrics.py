"""A pod's Prometheus metrics (``GET /metrics``, behind the token): calls taken and finished by
outcome, their durations, bytes in and out, each rank's restarts and use; rendered by
prometheus_client and read back with its own parser."""

from __future__ import annotations

import httpx
import pytest

import ktlite as kt
from ktlite_wire.headers import TOKEN_HEADER, bearer

prometheus_parser = pytest.importorskip("prometheus_client.parser")


def work(n: int, blob: bytes = b"") -> bytes:
    import os

    if n < 0:
        raise ValueError(f"rank {os.environ['RANK']} refuses {n}")
    return b"r" * n


def _scrape(remote) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    applied = remote.deployment.applied
    url = applied.endpoints[0].url + "/metrics"
    with httpx.Client(timeout=30, trust_env=False) as http:
        assert http.get(url).status_code == 401
        wrong = {"authorization": bearer("not-the-token")}
        assert http.get(url, headers=wrong).status_code == 401
        # a Prometheus scrape job's own credentials: `authorization: Bearer <token>`
        scraped = http.get(url, headers={"authorization": bearer(applied.token)})
        assert scraped.status_code == 200, scraped.text
        # ... and only for /metrics: every other route wants the deployment's header
        status = applied.endpoints[0].url + "/status"
        assert http.get(status, headers={"authorization": bearer(applied.token)}).status_code == 401
        answer = http.get(url, headers={TOKEN_HEADER: bearer(applied.token)})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    assert applied.token not in answer.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def test_metrics_count_calls_by_outcome_their_time_bytes_and_each_ranks_use() -> None:
    remote = kt.fn(work, name="metrics-pod").to(
        kt.Compute(cpus="0.1").distribute("spmd", workers=1, num_proc=2)
    )
    try:
        argument = b"a" * (1 << 20)
        assert remote(100_000) == [b"r" * 100_000] * 2
        with pytest.raises(kt.RemoteError):
            remote(-1)
        assert (
            remote.submit(len(argument), argument).result(timeout=60) == [b"r" * len(argument)] * 2
        )
        got = _scrape(remote)
    finally:
        remote.teardown()
    assert got[("ktlite_calls_total", ())] == 3
    assert got[("ktlite_calls_finished_total", (("outcome", "ok"),))] == 2
    assert got[("ktlite_calls_finished_total", (("outcome", "error"),))] == 1
    assert got[("ktlite_calls_finished_total", (("outcome", "died"),))] == 0
    assert got[("ktlite_call_duration_seconds_count", ())] == 3
    assert got[("ktlite_call_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("ktlite_call_duration_seconds_sum", ())] > 0
    assert got[("ktlite_inflight_calls", ())] == 0
    # two ranks' results of 100 kB and of 1 MiB went out
    assert got[("ktlite_call_sent_bytes_total", ())] >= 2 * (100_000 + (1 << 20))
    assert got[("ktlite_call_received_bytes_total", ())] >= 1 << 20  # the 1 MiB argument
    for rank in ("0", "1"):
        assert got[("ktlite_rank_rss_bytes", (("rank", rank),))] > 10 << 20
        assert got[("ktlite_rank_restarts", (("rank", rank),))] == 0
        assert ("ktlite_rank_cpu_percent", (("rank", rank),)) in got
    assert not [k for k in got if k[0].startswith("ktlite_rank_gpu")]  # no GPU here: none shown
