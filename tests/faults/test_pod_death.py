"""Issue 4, point 2: a pod's server dies (SIGKILL) or stops answering (SIGSTOP) during a
2 pods × 2 ranks call.

The call must fail within 10 s naming the pod, the ranks of the other pods must stop (no
rank keeps running a call the user can no longer see), no rank may run the call twice, and
a fresh ``.to()`` (which restarts a dead pod) must give a working deployment.

Every rank of the call writes a heartbeat line to its own file every 50 ms
(``faults_mod.beat``), so "the rank stopped" is read from outside: the time of its last
line, and its process gone. Times are measured from the signal to the error (or to the
last heartbeat), in this process, around nothing but the wait.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import faults_mod as fm
import pytest

import ktlite as kt

NAME = "fx-pod"
COMPUTE = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2, num_proc=2)
RANKS = range(4)
BOUND_S = 10.0  # issue 4, point 2: the pod's death is noticed and the call fails within 10 s
# A stopped pod is noticed by silence: no frame for 10 s (heartbeats every 2 s), so the
# error comes 8-10 s after the stop, plus what a loaded 2-core machine adds.
SILENCE_BOUND_S = 10.0 + 1.5
LONG_S = 30.0  # how long a faulted call's ranks would beat if nothing stopped them


@pytest.fixture(scope="module")
def deployment():
    """One deployment for the module; every test starts with a fresh ``.to()`` of it
    (milliseconds when the pods are healthy; restarts the pods a test killed)."""
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


def _stop_time(d, tag: str, rank: int, t0: float, bound: float) -> float:
    """Seconds from ``t0`` to the rank's last heartbeat; fails if it still beats."""
    last = fm.last_beat_after_quiet(d, tag, rank, quiet=1.0, timeout=bound + 5)
    assert last is not None, f"rank {rank} still runs the call {bound + 5:g}s after the fault"
    return max(0.0, last - t0)


def _stopped_by(d, tag: str, rank: int, t0: float, bound: float) -> float | None:
    """Seconds from ``t0`` to the rank's last heartbeat if it stopped by ``t0 + bound``
    (silent for 0.5 s by then), else None; reported either way."""
    last = fm.last_beat_after_quiet(
        d, tag, rank, quiet=0.5, timeout=max(0.0, t0 + bound - time.monotonic())
    )
    took = None if last is None else max(0.0, last - t0)
    print(f"[fault timing] rank {rank} stopped after: {took}", flush=True)
    return took


def _assert_ranks_stop(d, tag: str, ranks, t0: float, what: str, bound: float) -> None:
    for r in ranks:
        took = _stop_time(d, tag, r, t0, bound)
        fm.report(f"{what}: rank {r} stops", took, bound)
        assert took <= bound, f"rank {r} ran on for {took:.2f}s after the fault"
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
        5.0,
    )
    return remote


# ---- a pod's server dies -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_worker_pod_killed_mid_call_fails_naming_it_and_stops_the_rest(
    deployment, tmp_path
) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    call = _start(remote, tmp_path, "c")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert call.join(BOUND_S + 20), "the call hangs after pod 1 died"
    took = call.ended - t0
    fm.report("worker pod SIGKILL -> call fails", took, BOUND_S)
    assert took <= BOUND_S

    err = call.error
    assert isinstance(err, kt.RemoteError), repr(err)
    text = str(err)
    assert f"pod {NAME}-1" in text, text
    died = {f.rank: f for f in err.failures if f.kind != "cancelled"}
    assert sorted(died) == [2, 3], text
    assert {f.pod for f in died.values()} == {f"{NAME}-1"}
    assert all(f.kind == "cancelled" for f in err.failures if f.rank in (0, 1)), text
    assert sorted(f.rank for f in err.failures) == [0, 1, 2, 3]

    # pod 0's ranks are stopped by the coordinator; pod 1's, orphaned, must not run on either
    _assert_ranks_stop(tmp_path, "c", RANKS, t0, "worker pod SIGKILL", BOUND_S)
    _assert_ran_once(tmp_path, "c")
    remote = _assert_works(tmp_path, "after")
    assert _server_pids(remote)[1] != pid
    _assert_ran_once(tmp_path, "c")  # nothing re-ran the failed call meanwhile


@pytest.mark.timeout(90)
def test_coordinator_pod_killed_mid_call_raises_pod_unreachable(deployment, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[0]
    call = _start(remote, tmp_path, "c")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert call.join(BOUND_S + 20), "the call hangs after the coordinator pod died"
    took = call.ended - t0
    fm.report("coordinator pod SIGKILL -> PodUnreachable", took, BOUND_S)
    assert took <= BOUND_S
    err = call.error
    assert isinstance(err, kt.PodUnreachable), repr(err)
    assert isinstance(err, ConnectionError)
    # pod 1 notices the coordinator's stream close and stops its ranks; pod 0's are orphans
    _assert_ranks_stop(tmp_path, "c", RANKS, t0, "coordinator pod SIGKILL", BOUND_S)
    _assert_ran_once(tmp_path, "c")  # the client never re-sent the call
    _assert_works(tmp_path, "after")
    _assert_ran_once(tmp_path, "c")
    # last, as it is the known gap (see the xfail reason): the error names the pod
    assert f"{NAME}-0" in str(err), str(err)


# ---- a pod's server stops answering (alive, but SIGSTOPped) -------------------------------------


@pytest.mark.timeout(120)
def test_worker_pod_stopped_mid_call_fails_within_bound(deployment, stopped, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    call = _start(remote, tmp_path, "c")
    stopped.append(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    assert call.join(SILENCE_BOUND_S + 30), "the call hangs while pod 1 is stopped"
    took = call.ended - t0
    fm.report("worker pod SIGSTOP -> call fails", took, SILENCE_BOUND_S)
    err = call.error
    assert isinstance(err, kt.RemoteError), repr(err)
    assert f"pod {NAME}-1" in str(err) and "stopped responding" in str(err), str(err)
    assert sorted(f.rank for f in err.failures if f.kind != "cancelled") == [2, 3]
    # the coordinator stopped its own ranks when it noticed the silence
    _assert_ranks_stop(tmp_path, "c", (0, 1), t0, "worker pod SIGSTOP", SILENCE_BOUND_S)

    # resumed, the pod finds its caller gone and stops its ranks at once
    t1 = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    _assert_ranks_stop(tmp_path, "c", (2, 3), t1, "worker pod SIGCONT", 3.0)
    _assert_ran_once(tmp_path, "c")
    remote = _assert_works(tmp_path, "after")
    assert _server_pids(remote)[1] == pid  # the same pod, resumed: no restart needed
    # last, as it is the known gap (see the xfail reason)
    assert took <= SILENCE_BOUND_S, f"the call failed {took:.2f}s after pod 1 stopped"


@pytest.mark.timeout(120)
def test_coordinator_pod_stopped_mid_call_raises_and_stops_other_pods(
    deployment, stopped, tmp_path
) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[0]
    call = _start(remote, tmp_path, "c")
    stopped.append(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    assert call.join(SILENCE_BOUND_S + 30), "the call hangs while the coordinator is stopped"
    took = call.ended - t0
    fm.report("coordinator pod SIGSTOP -> PodUnreachable", took, SILENCE_BOUND_S)
    assert took <= SILENCE_BOUND_S
    err = call.error
    assert isinstance(err, kt.PodUnreachable), repr(err)
    assert "silent" in str(err) or "heartbeat" in str(err), str(err)
    # pod 1 is healthy: its ranks must not run on for a call whose caller has given up
    others_stop = [_stopped_by(tmp_path, "c", r, t0, SILENCE_BOUND_S + 1.0) for r in (2, 3)]

    t1 = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    _assert_ranks_stop(tmp_path, "c", (0, 1), t1, "coordinator pod SIGCONT", 3.0)
    _assert_ran_once(tmp_path, "c")
    _assert_works(tmp_path, "after")
    # last, the known gaps (see the xfail reason)
    assert None not in others_stop, (
        f"pod 1's ranks still ran the call {SILENCE_BOUND_S + 1.0:g}s after the coordinator stopped"
    )
    assert f"{NAME}-0" in str(err), str(err)


# ---- a fresh .to() after the death ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_to_right_after_a_pod_was_killed_restarts_it(deployment, tmp_path) -> None:
    remote = _fresh()
    pid = _server_pids(remote)[1]
    compute = dataclasses.replace(COMPUTE, launch_timeout=5.0)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        remote = kt.fn(fm.beat, name=NAME).to(compute)
    finally:
        fm.report("redeploy right after SIGKILL", time.monotonic() - t0, 5.0)
    assert remote(str(tmp_path), "after", 0) == [0, 1, 2, 3]
    assert _server_pids(remote)[1] != pid
