"""Issue 4, point 3: one rank raises while its siblings are blocked, with real processes.

The siblings block in a plain sleep (2 pods x 2 procs) or in a gloo all_reduce the failing
rank never joins (2 pods x 2 procs, torch). Each test checks that the siblings are stopped,
that the raise fails the call (its time from a timestamp the rank writes right before raising
is reported, not asserted: the siblings would sleep a minute, or wait in the all_reduce until
the call's 60 s timeout, so the raise's own error type shows what ended the call), that the
error is catchable by the rank's original exception type and is a
:class:`kt.RemoteError`, that its message lists every failed rank with its pod, that the
values of ranks that finished travel on the error (``err.results``, ``err.outcomes``), and
that the next call works.

A collective's ranks react to a peer's failure on their own (gloo raises "Connection reset by
peer" the moment a peer process goes). The last tests recreate that deterministically: a rank
holding 1 GiB takes ~0.1 s to die once its pod kills it, and a peer watching a canary in its
process group raises at once, before the coordinator's stop can reach it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import faults_rank as fr
import pytest

import ktlite as kt

RAISE_BOUND_S = 5.0  # issue 4 point 3: the call fails within 5 s (on a quiet machine; reported)
QUIET = {"stream_logs": False}
EXC = {"ValueError": ValueError, "FaultError": fr.FaultError}
SLOW_MIB = 1024  # a rank holding this much takes ~0.1 s to die once killed

_timings: dict[str, list[float]] = {}


@pytest.fixture(scope="module")
def sleepers(request):
    remote = kt.fn(fr.act, name="fre-sleep").to(
        kt.Compute(cpus=1, max_restarts=100).distribute("pytorch", workers=2, num_proc=2)
    )
    request.addfinalizer(remote.teardown)
    return remote


@pytest.fixture(scope="module")
def gloo(request):
    pytest.importorskip("torch")
    remote = kt.fn(fr.act, name="fre-gloo").to(
        kt.Compute(cpus=1, max_restarts=100).distribute("pytorch", workers=2, num_proc=2)
    )
    request.addfinalizer(remote.teardown)
    return remote


@pytest.fixture(scope="module", autouse=True)
def _report_timings():
    yield
    for kind, values in sorted(_timings.items()):
        print(
            f"DETECTION {kind}: n={len(values)} min={min(values):.3f}s "
            f"median={statistics.median(values):.3f}s max={max(values):.3f}s"
        )


def _context(err: BaseException) -> str:
    """What the user sees: the message and the notes under the traceback."""
    return str(err) + "\n" + "\n".join(getattr(err, "__notes__", []))


def _measure(kind: str, stamps: Path, rank: int, caught: float) -> float:
    took = caught - fr.read_stamp(stamps, rank)
    _timings.setdefault(kind, []).append(took)
    print(
        f"DETECT {kind} rank={rank}: the call failed {took:.3f}s after the raise "
        f"(bound {RAISE_BOUND_S:g}s on a quiet machine)"
    )
    return took


def _gone(pids: list[int], within: float = 3.0) -> list[int]:
    """The pids still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(fr.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if fr.pid_alive(p)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc,rank", [("ValueError", 1), ("FaultError", 3), ("ValueError", 2)])
def test_raise_while_siblings_sleep(sleepers, tmp_path, exc: str, rank: int) -> None:
    """Rank 0 returns at once, ``rank`` raises after 0.5 s, the other two sleep for a minute."""
    pids = sleepers.options(**QUIET)({"*": ("pid",)})
    blocked = [r for r in range(4) if r not in (0, rank)]
    plan = {0: ("return", "value of rank 0"), rank: ("raise", exc, 0.5), "*": ("sleep", 60)}
    with pytest.raises(EXC[exc]) as info:
        sleepers.options(**QUIET)(plan, str(tmp_path))
    _measure(f"raise-sleep-{exc}", tmp_path, rank, time.time())
    err = info.value
    assert isinstance(err, kt.RemoteError)
    assert type(err).__name__ == exc
    text = _context(err)
    pod = f"fre-sleep-{rank // 2}"
    assert f"rank {rank} on pod {pod}: " in text and f"injected {exc} on rank {rank}" in text
    assert "Traceback" in text and "raise _exc(" in text  # the rank's own traceback
    assert f"1 rank(s) failed: {rank}" in text
    # rank 0 finished before the failure: its value travels on the error
    assert err.results == {0: "value of rank 0"}
    assert set(err.outcomes) == {0, 1, 2, 3}
    assert err.outcomes[0] == "value of rank 0"
    assert isinstance(err.outcomes[rank], EXC[exc])
    assert str(err.outcomes[rank]) == f"injected {exc} on rank {rank}"
    assert err.failed_ranks == sorted([rank, *blocked])
    assert [f.rank for f in err.failures if f.kind == "error"] == [rank]
    assert {f.rank: f.kind for f in err.failures if f.rank != rank} == dict.fromkeys(
        blocked, "cancelled"
    )
    # the blocked siblings were stopped (interrupted), and keep their processes and state
    assert _gone([pids[r] for r in blocked], within=0.5) == [pids[r] for r in blocked]
    # the next call works
    assert sleepers.options(**QUIET)({"*": ("return", "again")}) == ["again"] * 4


@pytest.mark.timeout(60)
def test_two_ranks_raising_are_both_listed(sleepers, tmp_path) -> None:
    """Ranks 2 (pod 1) and 1 (pod 0) both raise as the call starts; ranks 0 and 3 sleep and
    are stopped (interrupted, their processes kept). Whichever raise lands first stops the
    call, and the other rank may be interrupted before it raises: every rank that raised is
    listed with its pod and its own exception, the others as cancelled."""
    plan = {2: ("raise", "FaultError", 0.0), 1: ("raise", "FaultError", 0.0), "*": ("sleep", 60)}
    with pytest.raises(fr.FaultError) as info:
        sleepers.options(**QUIET)(plan, str(tmp_path))
    err = info.value
    assert isinstance(err, kt.RemoteError)
    text = _context(err)
    raised = sorted(f.rank for f in err.failures if f.kind == "error")
    assert raised in ([1], [2], [1, 2]), text
    assert f"{len(raised)} rank(s) failed: {', '.join(map(str, raised))}" in text, text
    for r in raised:
        assert (
            f"rank {r} on pod fre-sleep-{r // 2}: " in text
            and f"injected FaultError on rank {r}" in text
        )
        assert isinstance(err.outcomes[r], fr.FaultError)
    assert {f.rank: f.pod for f in err.failures} == {
        0: "fre-sleep-0",
        1: "fre-sleep-0",
        2: "fre-sleep-1",
        3: "fre-sleep-1",
    }
    assert {f.rank: f.kind for f in err.failures if f.rank not in raised} == dict.fromkeys(
        {0, 1, 2, 3} - set(raised), "cancelled"
    )
    assert err.results == {}
    assert sleepers.options(**QUIET)({"*": ("return", 7)}) == [7] * 4


@pytest.mark.timeout(150)
def test_raise_outside_a_gloo_all_reduce(gloo, tmp_path) -> None:
    """Rank 1 joins the process group, then raises instead of joining the all_reduce ranks
    0, 2 and 3 wait in; twice (a built-in and a custom exception type), each time followed
    by a normal all_reduce on the same deployment."""
    assert gloo.options(**QUIET, timeout=60)({"*": ("gloo",)}) == [6.0] * 4
    for exc in ("ValueError", "FaultError"):
        stamps = tmp_path / exc
        stamps.mkdir()
        pids = gloo.options(**QUIET)({"*": ("pid",)})
        with pytest.raises(EXC[exc]) as info:
            gloo.options(**QUIET, timeout=60)({1: ("gloo_raise", exc), "*": ("gloo",)}, str(stamps))
        _measure(f"raise-gloo-{exc}", stamps, 1, time.time())
        err = info.value
        assert isinstance(err, kt.RemoteError) and type(err).__name__ == exc
        text = _context(err)
        assert "rank 1 on pod fre-gloo-0: " in text, text
        assert f"injected {exc} on rank 1, outside the all_reduce" in text
        assert isinstance(err.outcomes[1], EXC[exc]) and set(err.outcomes) == {0, 1, 2, 3}
        assert 1 in err.failed_ranks and err.results == {}
        # the ranks blocked in the all_reduce were stopped (interrupted, or killed after the
        # interrupt grace where the collective did not return to Python); rank 1 keeps its process
        assert _gone([pids[1]], within=0.1) == [pids[1]]
        # the next collective gets a fresh, complete process group
        assert gloo.options(**QUIET, timeout=60)({"*": ("gloo",)}) == [6.0] * 4, exc


@pytest.mark.timeout(60)
def test_outcomes_of_stopped_ranks_are_exceptions(sleepers) -> None:
    with pytest.raises(ValueError) as info:
        sleepers.options(**QUIET)({1: ("raise", "ValueError", 0.2), "*": ("sleep", 60)})
    outcomes = info.value.outcomes
    assert set(outcomes) == {0, 1, 2, 3}
    for r in (0, 2, 3):
        assert isinstance(outcomes[r], BaseException), (r, outcomes[r])
        assert isinstance(outcomes[r], kt.CallCancelled), (r, outcomes[r])


_ORDER_FIX = (
    "deploy._to_error (ktlite/modes/deploy.py) takes the lowest-numbered failing rank as the primary "
    "failure, so the collateral error of a lower rank that reacted to the failure (as gloo "
    "peers do: RuntimeError 'Connection reset/closed by peer') is what the call raises. Seen "
    "with real gloo ranks too: a death or a raise on rank 2/3 surfaced as rank 0/1's "
    "RuntimeError in most runs. Fix: record when each outcome was decided (e.g. "
    "`at=time.time()` on ranks.Outcome, carried through coordinator.PodOutcome and "
    "RankFailure), make the earliest failure the primary (its type is raised; a 'died' wins "
    "over an 'error' decided after it) and list the later ones as consequences"
)


@pytest.mark.timeout(60)
def test_collateral_error_on_another_pod_does_not_replace_the_type(sleepers, tmp_path) -> None:
    """Rank 3 raises FaultError first; pod 1 stops rank 2 (slow to die); rank 1 on pod 0
    raises ValueError the moment rank 2's process group is killed."""
    canary = str(tmp_path / "canary")
    plan = {
        3: ("raise", "FaultError", 0.0),
        2: ("slow_to_die", SLOW_MIB, canary),
        1: ("raise_when_gone", "ValueError", canary),
        "*": ("sleep", 60),
    }
    with pytest.raises(fr.FaultError) as info:
        sleepers.options(**QUIET)(plan, str(tmp_path), canary)
    assert "rank 3 on pod fre-sleep-1: " in _context(info.value)


@pytest.mark.timeout(60)
def test_death_stays_the_cause_when_a_peer_on_another_pod_reacts(sleepers, tmp_path) -> None:
    """Rank 3 kills itself (SIGKILL); pod 1 stops rank 2 (slow to die); rank 1 on pod 0 raises
    ValueError the moment rank 2's process group is killed."""
    canary = str(tmp_path / "canary")
    plan = {
        3: ("die", "sigkill", 0.0),
        2: ("slow_to_die", SLOW_MIB, canary),
        1: ("raise_when_gone", "ValueError", canary),
        "*": ("sleep", 60),
    }
    with pytest.raises(kt.RankDied) as info:
        sleepers.options(**QUIET)(plan, str(tmp_path), canary)
    assert "rank 3 on pod fre-sleep-1: rank process was killed by SIGKILL" in str(info.value)


@pytest.mark.timeout(60)
def test_own_exit_is_not_reported_as_cancelled(sleepers, tmp_path) -> None:
    """Rank 3 (holding 1 GiB, so its exit takes ~0.1 s) kills its canary and exits with code
    3; rank 2 on the same pod raises the moment the canary is gone."""
    canary = str(tmp_path / "canary")
    plan = {
        3: ("exit_slowly", SLOW_MIB, canary, 3),
        2: ("raise_when_gone", "ValueError", canary),
        "*": ("sleep", 60),
    }
    with pytest.raises(kt.RemoteError) as info:
        sleepers.options(**QUIET)(plan, str(tmp_path))
    kinds = {f.rank: f.kind for f in info.value.failures}
    assert kinds[3] == "died", kinds
    assert "rank 3 on pod fre-sleep-1: rank process exited with code 3" in _context(info.value)


# A module that stands for a C extension such as torch's: importing it registers it with the
# process (in ``sys``, which outlives a failed import), and a second registration is refused,
# as pybind11 refuses to define a type twice. ``SLOW_IMPORT_HOLD`` seconds of its import are
# spent after registering (torch's import takes seconds on a busy machine).
SLOW_IMPORT = """
import os, sys, time
from pathlib import Path

if getattr(sys, "_slow_import_registered", False):
    raise RuntimeError("generic_type: cannot initialize type 'SlowImport': an object with that "
                       "name is already defined")
sys._slow_import_registered = True
Path(os.environ["SLOW_IMPORT_MARKER"]).touch()
_end = time.monotonic() + float(os.environ["SLOW_IMPORT_HOLD"])
while time.monotonic() < _end:
    time.sleep(0.02)
VALUE = "imported"
"""


def import_slowly(folder: str, marker: str, hold: float) -> str:
    """Rank 0 imports ``slow_import`` from ``folder``; with ``hold``, rank 1 raises once that
    import began."""
    import importlib
    import os
    import sys

    if int(os.environ["RANK"]) == 1 and hold:
        deadline = time.monotonic() + 60
        while not Path(marker).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        raise ValueError("rank 1 fails while rank 0 is importing")
    os.environ["SLOW_IMPORT_MARKER"], os.environ["SLOW_IMPORT_HOLD"] = marker, str(hold)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("slow_import").VALUE


def test_a_rank_stopped_inside_an_import_is_replaced(tmp_path) -> None:
    """A sibling stopped while it imported a C extension (torch, under load, takes seconds)
    cannot import it again: the process must be replaced, not kept (issue 23, seen as
    ``cannot initialize type "RpcBackendOptions"`` on every later call of that rank)."""
    (tmp_path / "slow_import.py").write_text(SLOW_IMPORT)
    remote = kt.fn(import_slowly, name="fre-import").to(
        kt.Compute(cpus=1).distribute("pytorch", workers=1, num_proc=2)
    )
    try:
        with pytest.raises(kt.RemoteError, match="rank 1 fails while rank 0 is importing") as info:
            remote.options(**QUIET, timeout=90)(str(tmp_path), str(tmp_path / "began"), 60.0)
        assert info.value.failed_ranks == [0, 1], info.value  # rank 0 was stopped
        assert (
            remote.options(**QUIET, timeout=90)(str(tmp_path), str(tmp_path / "again"), 0.0)
            == ["imported"] * 2
        )
    finally:
        remote.teardown()
