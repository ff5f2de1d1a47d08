"""Issue 4, point 7: restarts (``max_restarts``) and health (``remote.status()``), with real
processes: rank processes the test kills between calls, stuck-worker detection while a call
runs, and what the deployment says once a rank has crashed more than ``max_restarts`` times.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import faults_rank as fr
import pytest
from loadscale import time_scale

import ktlite as kt

QUIET = {"stream_logs": False}
K = 2  # max_restarts of the deployment the crash-budget test exhausts
_serial = itertools.count()
FIELDS = {"rank", "local_rank", "pid", "state", "busy_for_s", "stuck", "last_exit", "restarts"}


def _deploy(name: str, max_restarts: int, request):
    remote = kt.fn(fr.act, name=name).to(
        kt.Compute(cpus=1, max_restarts=max_restarts).distribute("pytorch", workers=1, num_proc=2)
    )
    request.addfinalizer(remote.teardown)
    return remote


@pytest.fixture
def budget(request):
    """A fresh deployment per test: the crash budget test uses it up."""
    return _deploy(f"frs-budget-{next(_serial)}", K, request)


@pytest.fixture(scope="module")
def health(request):
    return _deploy("frs-health", 3, request)


def _ranks(remote, stuck_after: float | None = None) -> dict[int, dict]:
    return {r["rank"]: r for pod in remote.status(stuck_after) for r in pod["ranks"]}


def _kill_between_calls(remote, rank: int) -> int:
    """SIGKILL ``rank``'s process from outside (found in status()); wait until the pod server
    reports it dead, with its exit."""
    pid = _ranks(remote)[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5 * time_scale()  # awaited, not timed: grows with the load
    while (info := _ranks(remote)[rank])["state"] != "dead":
        assert time.monotonic() < deadline, f"the pod did not notice rank {rank} died: {info}"
        time.sleep(0.02)
    assert info["pid"] == pid and info["last_exit"] == -signal.SIGKILL, info
    assert not info["stuck"] and info["busy_for_s"] is None
    return pid


@pytest.mark.timeout(60)
def test_status_fields(health) -> None:
    pids = health.options(**QUIET)({"*": ("pid",)})
    pods = health.status()
    assert [p["pod"] for p in pods] == ["frs-health-0"]
    ranks = pods[0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert set(r) >= FIELDS, r
        assert r["pid"] == pids[r["rank"]] and fr.pid_alive(r["pid"])
        assert r["state"] == "idle" and r["busy_for_s"] is None and r["stuck"] is False
        assert isinstance(r["restarts"], int)
    assert pods[0]["active_calls"] == []


@pytest.mark.timeout(60)
def test_death_between_calls_is_restarted_until_max_restarts(budget) -> None:
    """K crashes between calls: each is restarted before the next call, which works, and
    counted. Crash K+1: the next call fails, starting nothing, with a clear kt.RankDied naming the rank,
    the pod, max_restarts and the way out; so does every call after it, never hanging, until
    restart_procs=True starts the rank processes fresh."""
    assert budget.options(**QUIET)({"*": ("return", 1)}) == [1, 1]
    for crash in range(1, K + 1):
        old = _kill_between_calls(budget, 1)
        start = time.monotonic()
        pids = budget.options(**QUIET)({"*": ("pid",)})
        print(f"call after crash {crash}: restarted and ran in {time.monotonic() - start:.2f}s")
        assert pids[1] != old and fr.pid_alive(pids[1])
        info = _ranks(budget)
        assert info[1]["restarts"] == crash and info[1]["state"] == "idle", info[1]
        assert info[0]["restarts"] == 0 and info[0]["pid"] == pids[0]  # untouched
    _kill_between_calls(budget, 1)
    for attempt in range(2):  # past the budget: a clear error every time, never a hang
        start = time.monotonic()
        with pytest.raises(kt.RankDied) as info:
            budget.options(**QUIET)({"*": ("return", 1)})
        print(f"call {attempt} past max_restarts={K}: failed in {time.monotonic() - start:.3f}s")
        text = str(info.value)
        assert "rank 1 on pod frs-budget-" in text, text
        assert f"died {K + 1} times" in text and f"max_restarts={K} reached" in text, text
        assert "killed by SIGKILL" in text and "restart_procs=True" in text, text
        assert 1 in info.value.failed_ranks
        status = _ranks(budget)
        assert status[1]["state"] == "dead" and status[1]["last_exit"] == -signal.SIGKILL
        assert status[1]["restarts"] == K
    # the way out the message names works, and the call after it too
    fresh = budget.options(restart_procs=True, **QUIET)({"*": ("pid",)})
    assert all(fr.pid_alive(p) for p in fresh)
    assert budget.options(**QUIET)({"*": ("pid",)}) == fresh


@pytest.mark.timeout(60)
def test_ranks_ktlite_stops_do_not_use_up_max_restarts(budget) -> None:
    """Siblings ktlite kills because another rank failed are no crashes: K + 2 failing calls
    leave their restart count at 0 and the deployment working."""
    for _ in range(K + 2):
        with pytest.raises(ValueError):
            budget.options(**QUIET)({1: ("raise", "ValueError", 0.1), "*": ("sleep", 60)})
    assert budget.options(**QUIET)({"*": ("return", 2)}) == [2, 2]
    info = _ranks(budget)
    assert [info[r]["restarts"] for r in (0, 1)] == [0, 0], info


@pytest.mark.timeout(60)
def test_restart_procs_gives_a_fresh_restart_budget(budget) -> None:
    for _ in range(K + 1):
        _kill_between_calls(budget, 1)
        try:
            budget.options(**QUIET)({"*": ("return", 0)})
        except kt.RankDied:
            break
    assert budget.options(restart_procs=True, **QUIET)({"*": ("return", 1)}) == [1, 1]
    _kill_between_calls(budget, 1)  # one crash after the forced restart: within the budget
    assert budget.options(**QUIET)({"*": ("return", 2)}) == [2, 2]


def _call_in_thread(remote, *args):
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = remote.options(**QUIET)(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.timeout(60)
def test_stuck_worker_detection(health) -> None:
    """While a call sleeps 2.5 s: status(stuck_after=1.0), asked from another thread, shows the
    ranks busy and, once they have run more than 1 s, stuck; the default threshold (600 s)
    does not. Afterwards they are idle and not stuck."""
    threshold = 1.0
    thread, box = _call_in_thread(health, {"*": ("sleep", 2.5)})
    seen_busy = seen_stuck = False
    deadline = time.monotonic() + 20
    while thread.is_alive() and time.monotonic() < deadline:
        ranks = _ranks(health, stuck_after=threshold)
        for r in ranks.values():
            if r["state"] != "busy":
                continue
            seen_busy = True
            busy = r["busy_for_s"]
            assert isinstance(busy, float) and busy >= 0, r
            if abs(busy - threshold) > 0.01:  # the server rounds busy_for_s to the ms
                assert r["stuck"] is (busy > threshold), r
            seen_stuck |= r["stuck"]
        if seen_stuck:
            default = _ranks(health)
            busy_now = [r for r in default.values() if r["state"] == "busy"]
            if busy_now:  # the call may just have ended
                assert all(r["busy_for_s"] > threshold and r["stuck"] is False for r in busy_now), (
                    default
                )
                break
        time.sleep(0.05)
    thread.join(20)
    assert box.get("value") == [0, 1], box
    assert seen_busy and seen_stuck, "status() never showed the sleeping ranks busy and stuck"
    for r in _ranks(health, stuck_after=threshold).values():
        assert r["state"] == "idle" and r["stuck"] is False and r["busy_for_s"] is None, r


@pytest.mark.timeout(60)
def test_stuck_after_zero_marks_any_running_call_and_bad_values_are_refused(health) -> None:
    thread, box = _call_in_thread(health, {"*": ("sleep", 1.0)})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ranks = _ranks(health, stuck_after=0.0)
        if all(r["state"] == "busy" for r in ranks.values()):
            break
        time.sleep(0.02)
    assert all(r["stuck"] for r in ranks.values()), ranks
    thread.join(20)
    assert box.get("value") == [0, 1], box
    with pytest.raises(kt.KtliteError, match="stuck_after"):
        health.status(stuck_after="soon")  # type: ignore[arg-type]
