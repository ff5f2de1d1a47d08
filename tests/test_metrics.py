"""A pod's Prometheus metrics (``GET /metrics``, behind the token): calls taken and finished by
outcome, their durations, bytes in and out, each rank's restarts and use; rendered by
prometheus_client and read back with its own parser."""

from __future__ import annotations

import time

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


def _idle_s(http: httpx.Client, url: str, token: str) -> float:
    answer = http.get(url + "/health", headers={TOKEN_HEADER: bearer(token)})
    assert answer.status_code == 200, answer.text
    return float(answer.json()["idle_s"])


def test_scraping_or_watching_a_pod_does_not_count_as_using_it() -> None:
    """A Prometheus scrape job or an open dashboard polls ``/metrics`` and ``/status`` for as
    long as the deployment lives; were that activity, an ``inactivity_ttl`` would never fire."""
    remote = kt.fn(work, name="metrics-idle").to(kt.Compute(inactivity_ttl="1h"))
    try:
        assert remote(1) == b"r"
        applied = remote.deployment.applied
        url, headers = applied.endpoints[0].url, {TOKEN_HEADER: bearer(applied.token)}
        with httpx.Client(timeout=30, trust_env=False) as http:
            deadline = time.monotonic() + 60
            idle = _idle_s(http, url, applied.token)
            while idle < 1.0:  # /health is never activity: wait until the pod has been idle a while
                assert time.monotonic() < deadline, f"idle_s stayed at {idle} for 60 s"
                time.sleep(0.1)
                idle = _idle_s(http, url, applied.token)
            for _ in range(3):
                assert http.get(url + "/status", headers=headers).status_code == 200
                assert http.get(url + "/metrics", headers=headers).status_code == 200
            after_watching = _idle_s(http, url, applied.token)
            assert after_watching >= idle, "/status or /metrics reset the pod's idle time"
            assert remote(1) == b"r"  # a call is activity
            after_a_call = _idle_s(http, url, applied.token)
            assert after_a_call < idle, "a call did not count as activity"
    finally:
        remote.teardown()
