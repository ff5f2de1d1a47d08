"""Submitted calls to a pod reached directly (``remote.submit`` on the local backend): no
thread of the caller's waits on them (``ktlite.modes.submissions``, ``ktlite.net.callmux``),
and each still ends in its own future with its own outcome, on real pod servers and ranks."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from loadscale import time_scale

import ktlite as kt
import ktlite.net.client
from ktlite_wire.heartbeat import HEARTBEAT_S

MEET_S = 60.0
SILENCE_S = round(HEARTBEAT_S + 2.0 * time_scale(), 1)


def nap(
    seconds: float,
    fail: bool = False,
    meet: tuple[str, int] | None = None,
    until: str | None = None,
) -> int:
    if meet is not None:  # until n calls are here: only calls that run at once get past it
        Path(meet[0], uuid.uuid4().hex).touch()
        deadline = time.monotonic() + MEET_S
        while len(os.listdir(meet[0])) < meet[1]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {meet[1]} calls ran at once after {MEET_S:g} s")
            time.sleep(0.02)
    for _ in range(int(seconds / 0.05)):  # short sleeps: an interrupt lands between them
        if until is not None and os.path.exists(until):  # let go early by the test
            break
        time.sleep(0.05)
    if fail:
        raise KeyError("this call fails on its own")
    return os.getpid()


def chatty(n: int) -> int:
    for i in range(n):
        print(f"line {i} of a submitted call", flush=True)
    return n


def big(n: int) -> bytes:
    return b"x" * n


@pytest.fixture(scope="module")
def napper():
    remote = kt.fn(nap).to(kt.Compute(cpus=1, concurrency=4, stream_logs=False), name="sub-nap")
    yield remote
    remote.teardown()


def _running(remote, n: int) -> None:
    """Until ``n`` calls run on the pod (bounded)."""
    deadline = time.monotonic() + 60
    while len(remote.status()[0]["active_calls"]) < n:
        assert time.monotonic() < deadline, f"{n} calls were not running after 60 s"
        time.sleep(0.05)


def test_submitted_calls_hold_no_thread_while_they_run(napper, tmp_path) -> None:
    futures = [napper.submit(1.0, meet=(str(tmp_path), 4)) for _ in range(4)]
    _running(napper, 4)
    waiting = [t.name for t in threading.enumerate() if t.name.startswith("ktlite-sub-nap")]
    assert waiting == [], f"threads wait on the submitted calls: {waiting}"
    assert len({f.result(timeout=90) for f in futures}) == 1  # all four ran, on the one rank


def test_each_future_of_a_batch_gets_its_own_outcome(napper) -> None:
    ok = napper.submit(0.3)
    fails = napper.submit(0.3, fail=True)
    timed = napper.options(timeout=1.0).submit(30.0)
    cancelled = napper.submit(30.0)
    _running(napper, 4)
    assert cancelled.cancel()
    assert isinstance(ok.result(timeout=60), int)
    assert isinstance(fails.exception(timeout=60), KeyError)
    assert isinstance(timed.exception(timeout=60), kt.CallTimeout), timed.exception()
    assert cancelled.cancelled()
    assert napper(0.0) == ok.result()  # the rank process kept running through all of it


def test_calls_queued_past_the_concurrency_leave_as_others_end(napper) -> None:
    futures = [napper.submit(0.0) for _ in range(50)]
    assert len({f.result(timeout=120) for f in futures}) == 1


def test_calls_past_the_silence_timeout_on_connections_the_reader_used(napper, monkeypatch) -> None:
    # the reader's connections wake it only from a whole head on (SO_RCVLOWAT): a call that
    # lives on heartbeats alone, through the reader or through a blocking read of the same
    # pooled connections, must still hear each one
    monkeypatch.setattr(ktlite.net.client, "SILENCE_TIMEOUT", SILENCE_S)
    assert len({f.result(timeout=60) for f in [napper.submit(0.0) for _ in range(8)]}) == 1
    long = 2 * SILENCE_S
    # both at once (the pod runs 4): the submitted one through the reader, the other a
    # blocking read on another of the 8 pooled connections
    submitted = napper.submit(long)
    assert isinstance(napper(long), int)
    assert isinstance(submitted.result(timeout=long + 60), int)
    assert len({f.result(timeout=60) for f in [napper.submit(0.0) for _ in range(8)]}) == 1


def test_log_lines_and_large_results_of_submitted_calls(capfd) -> None:
    # one call at a time: a rank running two at once streams its lines to both (it cannot
    # tell whose a line is)
    remote = kt.fn(chatty).to(kt.Compute(cpus=1, concurrency=1), name="sub-chatty")
    try:
        assert [f.result(timeout=60) for f in [remote.submit(3), remote.submit(2)]] == [3, 2]
        out = capfd.readouterr().out
        assert out.count("line 0 of a submitted call") == 2, out
        assert out.count("line 2 of a submitted call") == 1, out
    finally:
        remote.teardown()
    remote = kt.fn(big).to(kt.Compute(cpus=1, concurrency=2, stream_logs=False), name="sub-big")
    try:
        sizes = [3 << 20, 10, 200 << 10]
        assert [len(f.result(timeout=60)) for f in [remote.submit(n) for n in sizes]] == sizes
    finally:
        remote.teardown()


def test_a_pod_killed_or_stopped_mid_flight_fails_every_call_in_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(ktlite.net.client, "SILENCE_TIMEOUT", SILENCE_S)
    compute = kt.Compute(cpus=1, concurrency=4, stream_logs=False)
    remote = kt.fn(nap).to(compute, name="sub-death")
    release = tmp_path / "release"
    try:
        pid = remote.status()[0]["server_pid"]
        futures = [remote.submit(60.0, until=str(release)) for _ in range(3)]
        _running(remote, 3)
        os.kill(pid, signal.SIGSTOP)  # silent: noticed when no heartbeat comes
        try:
            errors = [f.exception(timeout=60) for f in futures]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(isinstance(e, kt.PodUnreachable) for e in errors), errors
        assert all(f"went silent for {SILENCE_S:g}s" in str(e) for e in errors), errors
        # the three calls the caller gave up on still run on the pod: let them end, so that
        # the next three get its concurrency's slots without waiting out their 60 s
        release.touch()

        remote = kt.fn(nap).to(compute, name="sub-death")
        futures = [remote.submit(60.0) for _ in range(3)]
        _running(remote, 3)
        os.kill(remote.status()[0]["server_pid"], signal.SIGKILL)  # gone: its connections close
        errors = [f.exception(timeout=60) for f in futures]
        # as a call made without submit says it: the connection lost, or (when the backend
        # already shows the pod gone) the deployment gone
        assert all(isinstance(e, (kt.PodUnreachable, kt.NotDeployedError)) for e in errors), errors
        assert all("sub-death" in str(e) for e in errors), errors
    finally:
        remote.teardown()


def test_submitted_calls_to_a_tls_pod() -> None:
    remote = kt.fn(big).to(kt.Compute(cpus=1, concurrency=4, tls=True), name="sub-tls")
    try:
        assert remote.deployment.endpoints[0].url.startswith("https://")
        sizes = [10] * 20 + [3 << 20, 200 << 10]
        assert [len(f.result(timeout=60)) for f in [remote.submit(n) for n in sizes]] == sizes
        assert len(remote(5)) == 5  # a call that waits, on the same connections
        # the submitted calls went over one link to the pod, in TLS pinned to the deployment
        port = int(remote.deployment.endpoints[0].url.rpartition(":")[2])
        links = [k for k in ktlite.net.client._links._links.values() if k.key[1] == port]
        assert len(links) == 1 and links[0].tls and links[0].key[2] is not None
    finally:
        remote.teardown()
