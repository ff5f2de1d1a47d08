"""distribute("monarch") with real Monarch: every local pod's server runs Monarch's worker
loop, the call runs on pod 0 (the controller), which spawns procs on every pod and calls
their endpoints.

Marked ``monarch``: not in the default run (about half a minute); ``.ci/run`` runs it with
the other real-engine tests (``pytest -m "ray or monarch"``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.backends.processes import pid_alive
from ktlite_server.engine import session_pids

pytest.importorskip("monarch.actor")
pytestmark = [pytest.mark.monarch, pytest.mark.timeout(240)]

COMPUTE = kt.Compute(cpus=1).distribute("monarch", workers=2, num_proc=2)


def who_runs(x: int) -> list[dict]:
    """An endpoint on every proc of every pod: which pod's loop spawned each proc."""
    import os

    from monarch.actor import Actor, endpoint

    from ktlite.distributed import monarch_procs

    class Who(Actor):
        @endpoint
        def who(self, x: int) -> dict:
            return {"pid": os.getpid(), "parent": os.getppid(), "x2": x * 2}

    procs = monarch_procs()  # per_host={"gpus": 2}: num_proc
    try:
        answers = procs.spawn("who", Who).who.call(x).get()
        return [{"point": dict(point), **value} for point, value in answers.items()]
    finally:
        procs.stop().get()


def failing_endpoint() -> None:
    from monarch.actor import Actor, endpoint

    from ktlite.distributed import monarch_procs

    class Shard(Actor):
        @endpoint
        def load(self, x: int) -> None:
            raise KeyError(f"no shard {x}")

    procs = monarch_procs(per_host={"gpus": 1})
    try:
        procs.spawn("shard", Shard).load.call(7).get()
    finally:
        procs.stop().get()


def leave_procs_running() -> int:
    """Spawns procs and does not stop them (a controller that forgot, or died)."""
    from monarch.actor import Actor, endpoint

    from ktlite.distributed import monarch_procs

    class Idle(Actor):
        @endpoint
        def ping(self) -> int:
            return 1

    actors = monarch_procs().spawn("idle", Idle)
    return sum(v for _, v in actors.ping.call().get().items())


class Trainer:
    """The controller as a class: the mesh and its actors live across calls."""

    def __init__(self) -> None:
        from monarch.actor import Actor, endpoint

        from ktlite.distributed import monarch_procs

        class Counter(Actor):
            def __init__(self) -> None:
                self.n = 0

            @endpoint
            def step(self) -> int:
                self.n += 1
                return self.n

        self.procs = monarch_procs(per_host={"gpus": 1})
        self.counters = self.procs.spawn("counter", Counter)

    def step(self) -> list[int]:
        return sorted(v for _, v in self.counters.step.call().get().items())


def deploy(fn, name: str = "mesh"):
    return kt.fn(fn, name=name).to(COMPUTE)


@pytest.fixture(scope="module")
def mesh():
    remote = deploy(who_runs)
    yield remote
    remote.teardown()


def _engines(remote) -> list[dict]:
    return [pod["engine"] for pod in remote.status()]


def test_an_endpoint_runs_on_every_proc_of_every_pod(mesh) -> None:
    rows = mesh(21)  # one value, from the controller on pod 0
    assert len(rows) == 4 and all(r["x2"] == 42 for r in rows)
    assert sorted((r["point"]["hosts"], r["point"]["gpus"]) for r in rows) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    loops = [e["pid"] for e in _engines(mesh)]
    # host k's procs are children of pod k's worker loop
    for r in rows:
        assert r["parent"] == loops[r["point"]["hosts"]], (r, loops)
    assert len({r["pid"] for r in rows}) == 4


def test_status_shows_every_pods_loop(mesh) -> None:
    head, other = _engines(mesh)
    assert head["kind"] == "monarch" and head["alive"] and other["alive"] and head["lost"] == []
    assert [h["reachable"] for h in head["hosts"]] == [True, True]
    assert head["hosts"][1]["address"] == other["address"]


def test_an_endpoint_error_keeps_its_type(mesh) -> None:
    with pytest.raises(KeyError, match="no shard 7") as info:
        deploy(failing_endpoint)()
    assert "ActorError" not in type(info.value).__name__


def test_a_class_controller_keeps_its_actors_across_calls(mesh) -> None:
    trainer = kt.cls(Trainer, name="mesh").to(COMPUTE)
    assert trainer.step() == [1, 1]
    assert trainer.step() == [2, 2]


def test_each_to_brings_fresh_loops_without_old_procs(mesh) -> None:
    remote = deploy(leave_procs_running)
    assert remote() == 4
    before = _engines(remote)
    assert [e["procs"] for e in before] == [2, 2]  # left running by the controller
    leftover = _session_pids([e["pid"] for e in before])
    remote = deploy(leave_procs_running)
    after = _engines(remote)
    assert {e["pid"] for e in after}.isdisjoint(e["pid"] for e in before)
    assert [e["procs"] for e in after] == [0, 0]
    assert not [p for p in leftover if pid_alive(p)]
    assert remote() == 4  # the new controller attaches to the new loops


def test_a_lost_host_shows_in_status(mesh) -> None:
    remote = deploy(who_runs)
    pid = _engines(remote)[1]["pid"]
    os.kill(pid, signal.SIGKILL)  # pod 1's loop dies as a host would
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        head = _engines(remote)[0]
        if head["lost"]:
            break
        time.sleep(0.5)
    assert head["lost"] == ["mesh-1"], head
    assert remote.status()[1]["engine"]["alive"] is False


def test_teardown_leaves_no_monarch_behind(mesh) -> None:
    remote = deploy(leave_procs_running)
    assert remote() == 4
    engines = _engines(remote)
    sockets = [Path(e["address"][len("ipc://") :]) for e in engines]
    assert all(s.exists() for s in sockets)
    pids = _session_pids([e["pid"] for e in engines])
    assert len(pids) == 2 + 4  # two loops, two procs each
    remote.teardown()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and [p for p in pids if pid_alive(p)]:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]
    assert not sockets[0].parent.exists()  # the private socket directory is gone


def test_a_loop_that_cannot_start_fails_to_with_its_output(tmp_path: Path) -> None:
    # a `monarch` package that cannot start shadows the real one on the pods
    fake = tmp_path / "monarch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "actor.py").write_text(
        "raise SystemExit('this monarch cannot start: broken on purpose')\n"
    )
    compute = kt.Compute(env={"PYTHONPATH": str(tmp_path)}).distribute("monarch", workers=2)
    with pytest.raises(kt.DeployError) as info:
        kt.fn(who_runs, name="mesh-broken").to(compute)
    text = str(info.value)
    assert (
        "worker loop exited with code 1" in text
        and "broken on purpose" in text
        and "mesh-broken-0" in text
    )
    kt.fn(who_runs, name="mesh-broken").to(kt.Compute()).teardown()


def _session_pids(sids: list[int]) -> list[int]:
    return [pid for sid in sids for pid in session_pids(sid)]
