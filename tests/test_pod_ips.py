"""``ktlite.distributed.pod_ips`` inside real local deployments: the quorum met at once, a
quorum that cannot be met (an error after quorum_timeout, never a shorter list), outside a
deployment, bad arguments, and the list kept current when a redeploy adds a pod."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import ktlite as kt
from ktlite.distributed import QuorumNotMet, pod_ips


def report(quorum_workers: int | None = None, quorum_timeout: float = 5.0) -> dict:
    """Runs on every rank: what pod_ips() says there, and how long it took."""
    import os
    import time

    from ktlite.distributed import pod_ips

    start = time.monotonic()
    ips = pod_ips(quorum_workers=quorum_workers, quorum_timeout=quorum_timeout)
    return {
        "ips": ips,
        "took": time.monotonic() - start,
        "env": os.environ["POD_IPS"],
        "pod": os.environ["KTLITE_POD_NAME"],
        "rank": int(os.environ["RANK"]),
    }


@pytest.fixture(scope="module")
def two_pods() -> Iterator[kt.RemoteFunction]:
    compute = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2, num_proc=2)
    remote = kt.fn(report, name="podips-two").to(compute)
    try:
        yield remote
    finally:
        remote.teardown()


@pytest.mark.timeout(60)
def test_pod_ips_inside_two_pods_returns_two_sorted_addresses(two_pods: kt.RemoteFunction) -> None:
    results = two_pods()
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert sorted({r["pod"] for r in results}) == ["podips-two-0", "podips-two-1"]
    for r in results:
        env = r["env"].split(",")
        assert len(r["ips"]) == 2, r  # one address per pod, not per rank
        assert r["ips"] == sorted(r["ips"])
        assert sorted(r["ips"]) == sorted(env) and set(r["ips"]) == set(env)
    assert all(r["ips"] == results[0]["ips"] for r in results)


@pytest.mark.timeout(60)
def test_quorum_met_returns_at_once(two_pods: kt.RemoteFunction) -> None:
    # at once, not after the quorum timeout: a wait for it would run into the call's timeout
    for r in two_pods.options(timeout=45)(quorum_workers=2, quorum_timeout=3600):
        assert len(r["ips"]) == 2, r
    for r in two_pods(quorum_workers=1, quorum_timeout=0):  # fewer wanted: all are still returned
        assert len(r["ips"]) == 2, r


@pytest.mark.timeout(60)
def test_quorum_not_met_raises_after_the_timeout_naming_what_it_saw(
    two_pods: kt.RemoteFunction,
) -> None:
    start = time.monotonic()
    with pytest.raises(QuorumNotMet) as info:
        two_pods(quorum_workers=3, quorum_timeout=1)
    took = time.monotonic() - start
    assert took >= 1, took  # after the timeout (a wait without end is pytest-timeout's to catch)
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, kt.RemoteError)
    message = str(err)
    assert "quorum_workers=3" in message and "saw 2 pod(s)" in message, message
    assert "127.0.0.1" in message and "quorum_timeout=1s" in message, message
    assert not err.results  # no rank returned a shorter list


@pytest.mark.timeout(60)
def test_bad_arguments_inside_a_deployment_raise_config_error(two_pods: kt.RemoteFunction) -> None:
    with pytest.raises(kt.ConfigError, match="quorum_workers=0"):
        two_pods(quorum_workers=0)
    with pytest.raises(kt.ConfigError, match="quorum_timeout=-1"):
        two_pods(quorum_workers=2, quorum_timeout=-1)
    assert len(two_pods(quorum_workers=2)) == 4  # still usable


def test_outside_a_deployment_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_IPS", raising=False)
    monkeypatch.delenv("KTLITE_POD_IPS_FILE", raising=False)
    with pytest.raises(kt.KtliteError, match="inside a ktlite deployment"):
        pod_ips()
    with pytest.raises(kt.KtliteError, match="inside a ktlite deployment"):
        pod_ips(quorum_workers=1, quorum_timeout=0)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"quorum_workers": 0}, "quorum_workers=0"),
        ({"quorum_workers": -1}, "quorum_workers=-1"),
        ({"quorum_workers": True}, "quorum_workers=True"),
        ({"quorum_workers": 1.5}, "quorum_workers=1.5"),
        ({"quorum_workers": "2"}, "quorum_workers='2'"),
        ({"quorum_timeout": -1}, "quorum_timeout=-1"),
        ({"quorum_timeout": "5"}, "quorum_timeout='5'"),
        ({"quorum_timeout": True}, "quorum_timeout=True"),
    ],
)
def test_bad_arguments_raise_config_error(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict, words: str
) -> None:
    monkeypatch.delenv("KTLITE_POD_IPS_FILE", raising=False)
    monkeypatch.setenv("POD_IPS", "127.0.0.1,127.0.0.1")  # as a rank of a 2-pod deployment sees it
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(kt.ConfigError) as info:
        pod_ips(**kwargs)
    assert words in str(info.value)


def test_nan_quorum_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KTLITE_POD_IPS_FILE", raising=False)
    monkeypatch.setenv("POD_IPS", "127.0.0.1,127.0.0.1")
    with pytest.raises(kt.ConfigError, match="quorum_timeout"):
        pod_ips(quorum_workers=1, quorum_timeout=float("nan"))  # met at once: must still refuse


@pytest.mark.timeout(90)
def test_a_redeploy_with_three_workers_updates_the_running_pods() -> None:
    compute = kt.Compute(cpus=1, stream_logs=False)
    remote = kt.fn(report, name="podips-grow").to(compute.distribute("pytorch", workers=2))
    try:
        assert [len(r["ips"]) for r in remote()] == [2, 2]
        with pytest.raises(QuorumNotMet):
            remote(quorum_workers=3, quorum_timeout=0.5)
        kept = {p["pod"]: p["server_pid"] for p in remote.status()}

        remote = kt.fn(report, name="podips-grow").to(compute.distribute("pytorch", workers=3))
        # pods 0 and 1 were kept (same server process) and learnt of pod 2
        assert {p["pod"]: p["server_pid"] for p in remote.status()[:2]} == kept
        # at once: pods 0 and 1 knew of pod 2 before the call (a wait for the quorum timeout
        # would run into the call's timeout)
        results = remote.options(timeout=45)(quorum_workers=3, quorum_timeout=3600)
        assert [r["pod"] for r in results] == ["podips-grow-0", "podips-grow-1", "podips-grow-2"]
        for r in results:
            assert len(r["ips"]) == 3 and r["ips"] == sorted(r["ips"]), r
    finally:
        remote.teardown()
