"""Issue 4, point 2: a pod's server dies (SIGKILL) or stops answering (SIGSTOP) during a
2 pods × 2 ranks call.

The call must fail naming the pod, the ranks of the other pods must stop (no rank keeps
running a call the user can no longer see), no rank may run the call twice, and a fresh
``.to()`` (which restarts a dead pod) must give a working deployment.

Every rank of the call writes a heartbeat line to its own file every 50 ms
(``faults_mod.beat``), so "the rank stopped" is read from outside: its last line, well before
the end it would have reached had nothing stopped it (``LONG_S``). No check here is a
wall-clock bound (the suite runs on busy machines too): that the fault, not the call's end,
ended each wait is read from what happened instead: the call fails with the fault's error
(left alone its ranks would have returned after ``LONG_S``) and the ranks stop before their
natural end. The times are reported (``pytest -s``).

A stopped pod is noticed by silence: ``KTLITE_SILENCE_TIMEOUT`` (``ktlite_wire.heartbeat``)
is set short here, in the caller (``ktlite.net.client.SILENCE_TIMEOUT``) and in the pods
(``Compute(env=...)``, read by the coordinator), and the errors name that value, so they show
which wait noticed it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import faults_mod as fm
import pytest
from loadscale import time_scale

import ktlite as kt
import ktlite.net.client
from ktlite_wire.heartbeat import HEARTBEAT_S, SILENCE_ENV

NAME = "fx-pod"
# a heartbeat interval (2 s) plus 2 s of margin on a quiet machine, more on a loaded one
SILENCE_S = round(HEARTBEAT_S + 2.0 * time_scale(), 1)
COMPUTE = kt.Compute(cpus=1, stream_logs=False, env={SILENCE_ENV: str(SILENCE_S)}).distribute(
    "pytorch", workers=2, num_proc=2
)
RANKS = range(4)
LONG_S = 60.0  # how long a faulted call's ranks would beat if nothing stopped them
JOIN_S = LONG_S + 30  # a guard against a hang: the fault's error comes long before


@pytest.fixture(scope="module")
def deployment():
    """One deployment for the module; every test starts with a fresh ``.to()`` of it
    (milliseconds when the pods are healthy; restarts the pods a test killed). The caller's
    silence timeout is the pods' (SILENCE_S) for the module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ktlite.net.client, "SILENCE_TIMEOUT", SILENCE_S)
        yield NAME
    from ktlite.backends.local import LocalBackend

    LocalBackend.shared().teardown(NAME, timeout=5.0)


@pytest.fixture
def stopped(deployment):
    """Pids a test SIGSTOPs; resumed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    fm.recover(NAME, pids)


def _fresh() -> kt.RemoteFunction:
    return kt.fn(fm.beat, name=NAME).to(COMPUTE)


def _server_pids(remote: kt.RemoteFunction) -> list[int]:
    pids = [pod["server_pid"] for pod in remote.status()]
    assert pids == [p["pid"] for p in fm.local_state(NAME)["pods"]]
    return pids


def _start(remote: kt.RemoteFunction, d, tag: str) -> fm.Call:
    call = fm.Call(remote, str(d), tag, LONG_S)
    assert fm.wait_for(lambda: fm.all_beating(d, tag, RANKS), 30), (
        "the call never started on every rank"
    )
    assert call.ended is None
    return call


def _stop_time(d, tag: str, rank: int, t0: float) -> float:
    """Seconds from ``t0`` to the rank's last heartbeat, once it has stopped; fails if it beat
    on to the end it would have reached had nothing stopped it."""
    last = fm.last_beat_after_quiet(d, tag, rank, quiet=1.0, timeout=JOIN_S)
    assert last is not None, f"rank {rank} still runs the call {JOIN_S:g}s after the fault"
    first = fm.starts(d, tag, rank)[0][1]
    assert last < first + LONG_S - 5, f"rank {rank} beat to the end of the call: nothing stopped it"
    return max(0.0, last - t0)


def _assert_ranks_stop(d, tag: str, ranks, t0: float, what: str) -> None:
    for r in ranks:
        fm.report(f"{what}: rank {r} stops", _stop_time(d, tag, r, t0), SILENCE_S)
        # the call stopped; a surviving rank keeps its process (and state): partial restarts


def _assert_ran_once(d, tag: str) -> None:
    for r in RANKS:
        assert len(fm.starts(d, tag, r)) == 1, (
            f"rank {r} ran call {tag!r} {len(fm.starts(d, tag, r))} times"
        )


def _assert_works(d, tag: str) -> kt.RemoteFunction:
    """A fresh ``.to()`` gives a deployment whose next call works on every rank."""
    remote = _fresh()
    assert remote(str(d), tag, 0) == [0, 1, 2, 3]
    assert fm.wait_for(
        lambda: all(
            rank["state"] == "idle" and not pod["active_calls"]
            for pod in remote.status()
            for rank in pod["ranks"]
        ),
        60.0,
    ), f"the pods were not idle after a call: {remote.status()}"
    return remote


# ---- a pod's server dies -----------------------------------------------------------------------


def _ended_by_the_fault(call: fm.Call, t0: float, what: str) -> BaseException:
    """The call's error, once it has ended (a hang fails after JOIN_S). Left alone, the call
    would have returned every rank's value after LONG_S: an error that is not the call's
    timeout (it has none) shows that the fault ended the wait."""
    assert call.join(JOIN_S), f"the call hangs after {what}"
    assert call.ended is not None
    fm.report(f"{what} -> the call fails", call.ended - t0, SILENCE_S)
    assert call.error is not None, f"the call returned {call.value!r} after {what}"
    assert not isinstance(call.error, kt.CallTimeout), repr(call.error)
    return call.error


@pytest.mark.timeout(120)
def test_worker_pod_killed_mid_call_fails_naming_it_and_stops_the_rest(
    deployment, tmp_path
) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    call = _start(remote, tmp_path, "c")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    err = _ended_by_the_fault(call, t0, "worker pod SIGKILL")

    assert isinstance(err, kt.RemoteError), repr(err)
    text = str(err)
    assert f"pod {NAME}-1" in text, text
    # noticed by the broken connection, not by the silence timeout
    assert "stopped responding" not in text, text
    died = {f.rank: f for f in err.failures if f.kind != "cancelled"}
    assert sorted(died) == [2, 3], text
    assert {f.pod for f in died.values()} == {f"{NAME}-1"}
    assert all(f.kind == "cancelled" for f in err.failures if f.rank in (0, 1)), text
    assert sorted(f.rank for f in err.failures) == [0, 1, 2, 3]

    # pod 0's ranks are stopped by the coordinator; pod 1's, orphaned, must not run on either
    _assert_ranks_stop(tmp_path, "c", RANKS, t0, "worker pod SIGKILL")
    _assert_ran_once(tmp_path, "c")
    remote = _assert_works(tmp_path, "after")
    assert _server_pids(remote)[1] != pid
    _assert_ran_once(tmp_path, "c")  # nothing re-ran the failed call meanwhile


@pytest.mark.timeout(120)
def test_coordinator_pod_killed_mid_call_raises_pod_unreachable(deployment, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[0]
    call = _start(remote, tmp_path, "c")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    err = _ended_by_the_fault(call, t0, "coordinator pod SIGKILL")
    assert isinstance(err, kt.PodUnreachable), repr(err)
    assert isinstance(err, ConnectionError)
    assert "went silent" not in str(err), str(err)  # the connection broke: no silence wait
    # pod 1 notices the coordinator's stream close and stops its ranks; pod 0's are orphans
    _assert_ranks_stop(tmp_path, "c", RANKS, t0, "coordinator pod SIGKILL")
    _assert_ran_once(tmp_path, "c")  # the client never re-sent the call
    _assert_works(tmp_path, "after")
    _assert_ran_once(tmp_path, "c")
    assert f"{NAME}-0" in str(err), str(err)


# ---- a pod's server stops answering (alive, but SIGSTOPped) -------------------------------------


@pytest.mark.timeout(150)
def test_worker_pod_stopped_mid_call_fails_naming_it(deployment, stopped, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    call = _start(remote, tmp_path, "c")
    stopped.append(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    err = _ended_by_the_fault(call, t0, "worker pod SIGSTOP")
    assert isinstance(err, kt.RemoteError), repr(err)
    # the coordinator's silence timeout (the pods' KTLITE_SILENCE_TIMEOUT) noticed it
    assert f"pod {NAME}-1 stopped responding" in str(err), str(err)
    assert f"no data or heartbeat for {SILENCE_S:g}s" in str(err), str(err)
    assert sorted(f.rank for f in err.failures if f.kind != "cancelled") == [2, 3]
    # the coordinator stopped its own ranks when it noticed the silence
    _assert_ranks_stop(tmp_path, "c", (0, 1), t0, "worker pod SIGSTOP")

    # resumed, the pod finds its caller gone and stops its ranks
    t1 = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    _assert_ranks_stop(tmp_path, "c", (2, 3), t1, "worker pod SIGCONT")
    _assert_ran_once(tmp_path, "c")
    remote = _assert_works(tmp_path, "after")
    assert _server_pids(remote)[1] == pid  # the same pod, resumed: no restart needed


@pytest.mark.timeout(150)
def test_coordinator_pod_stopped_mid_call_raises_and_stops_other_pods(
    deployment, stopped, tmp_path
) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[0]
    call = _start(remote, tmp_path, "c")
    stopped.append(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    err = _ended_by_the_fault(call, t0, "coordinator pod SIGSTOP")
    assert isinstance(err, kt.PodUnreachable), repr(err)
    # the caller's silence timeout (its KTLITE_SILENCE_TIMEOUT) noticed it
    assert f"went silent for {SILENCE_S:g}s" in str(err), str(err)
    assert f"{NAME}-0" in str(err), str(err)
    # pod 1 is healthy: its ranks must not run on for a call whose caller has given up (the
    # caller cancels the call there), while the coordinator is still stopped
    _assert_ranks_stop(tmp_path, "c", (2, 3), t0, "coordinator pod SIGSTOP")

    t1 = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    _assert_ranks_stop(tmp_path, "c", (0, 1), t1, "coordinator pod SIGCONT")
    _assert_ran_once(tmp_path, "c")
    _assert_works(tmp_path, "after")


# ---- a fresh .to() after the death ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_to_right_after_a_pod_was_killed_restarts_it(deployment, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    compute = dataclasses.replace(COMPUTE, launch_timeout=round(5.0 * time_scale(), 1))
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        remote = kt.fn(fm.beat, name=NAME).to(compute)
    finally:
        fm.report("redeploy right after SIGKILL", time.monotonic() - t0, compute.launch_timeout)
    assert remote(str(tmp_path), "after", 0) == [0, 1, 2, 3]
    assert _server_pids(remote)[1] != pid
