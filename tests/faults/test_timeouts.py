"""Issue 4, point 4: every wait has a timeout with a default and an override, and each
timeout error says what was awaited, what had arrived, and what to try.

- launch: pods whose server never comes up (a ``sitecustomize`` on their PYTHONPATH that
  blocks, as a hung import on a dead network mount would) → ``kt.LaunchTimeout``;
- quorum: a worker pod unreachable before the fan-out → ``kt.QuorumTimeout``, and no rank
  ran the function (a job never runs with fewer ranks);
- call: ``remote.options(timeout=S)`` / ``Compute(call_timeout=S)`` → ``kt.CallTimeout``
  naming the ranks still running; no limit by default;
- teardown: pods that ignore SIGTERM (SIGSTOPped) are killed after ``teardown(timeout=S)``.

Times are measured around the one call that waits, and printed (``pytest -s`` / ``-rA``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import textwrap
import time
from pathlib import Path

import faults_mod as fm
import pytest
from loadscale import time_scale

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.modes.deploy import CallOptions
from ktlite_server.peers import PROBE_AFTER_S

NAME = "fx-timeouts"
COMPUTE = kt.Compute(cpus=1, stream_logs=False).distribute(
    "pytorch", workers=2, num_proc=1, quorum_timeout=2
)
# what a quiet 2-core machine may add to a timeout: reported beside each time, never asserted
# (a loaded machine adds more). That the timeout, not something else, ended a wait is read from
# what happened: its error type, and work that would have run far longer stopped
SLACK_S = 2.0

# Blocks the pod *server* (not its rank processes) of the ordinals listed in FX_HANG_PODS
# forever, and delays those in FX_SLOW_PODS by FX_SLOW_S seconds, at interpreter start-up.
SITECUSTOMIZE = textwrap.dedent("""
    import os
    import time

    with open("/proc/self/cmdline", "rb") as _f:
        _argv = _f.read().split(b"\\0")
    if b"ktlite_server" in _argv:
        _me = os.environ.get("KTLITE_POD_ORDINAL", "")
        if _me in os.environ.get("FX_SLOW_PODS", "").split(","):
            time.sleep(float(os.environ.get("FX_SLOW_S", "0")))
        if _me in os.environ.get("FX_HANG_PODS", "").split(","):
            while True:
                time.sleep(1)
""")


def _site(tmp_path: Path) -> str:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(site)


def _servers_of(name: str) -> list[int]:
    """Pids of this test process's pod servers of deployment ``name`` still running (theirs:
    their ready file is under this process's KTLITE_HOME; other ktlite test runs on the
    machine start pods of the same names)."""
    home = os.environ["KTLITE_HOME"].encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"ktlite_server" in argv
            and any(a.startswith(f"{name}-".encode()) for a in argv)
            and any(a.startswith(home) for a in argv)
            and fm.pid_alive(int(proc.name))
        ):
            out.append(int(proc.name))
    return out


@pytest.fixture(scope="module")
def deployment():
    yield NAME
    LocalBackend.shared().teardown(NAME, timeout=5.0)


@pytest.fixture
def stopped(deployment):
    pids: list[int] = []
    yield pids
    fm.recover(NAME, pids)


def _fresh(compute: kt.Compute = COMPUTE) -> kt.RemoteFunction:
    return kt.fn(fm.beat, name=NAME).to(compute)


def _no_rank_started(d: Path, tag: str, ranks=range(2)) -> None:
    ran = {r: fm.starts(d, tag, r) for r in ranks if fm.starts(d, tag, r)}
    assert not ran, f"rank(s) {sorted(ran)} ran the function although the call failed its quorum"


# ---- defaults --------------------------------------------------------------------------------


def test_timeout_defaults() -> None:
    """launch 600 s, quorum 300 s, call: no limit, teardown 30 s."""
    compute = kt.Compute()
    assert compute.launch_timeout == 600
    assert compute.distribute(workers=2).distributed.quorum_timeout == 300
    assert compute.call_timeout is None and CallOptions().timeout is None
    assert compute.teardown_timeout == 30
    for bad in (0, -1, True, "5"):
        with pytest.raises(kt.ConfigError, match="launch_timeout"):
            kt.Compute(launch_timeout=bad)
        with pytest.raises(kt.ConfigError, match="quorum_timeout"):
            kt.Compute().distribute(workers=2, quorum_timeout=bad)
        with pytest.raises(kt.ConfigError, match="call_timeout"):
            kt.Compute(call_timeout=bad)
        with pytest.raises(kt.ConfigError, match="teardown_timeout"):
            kt.Compute(teardown_timeout=bad)


# ---- launch ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_launch_timeout_when_pods_never_come_up(tmp_path) -> None:
    name = "fx-launch"
    limit = 3.0
    compute = kt.Compute(
        cpus=1, launch_timeout=limit, env={"PYTHONPATH": _site(tmp_path), "FX_HANG_PODS": "0,1"}
    )
    t0 = time.monotonic()
    with pytest.raises(kt.LaunchTimeout) as info:
        kt.fn(fm.rank_of, name=name).to(compute.distribute("pytorch", workers=2))
    took = time.monotonic() - t0
    fm.report("launch: pods never come up -> LaunchTimeout", took, limit + SLACK_S)
    assert limit <= took  # the pods hang forever: only the launch timeout ends this wait
    err = info.value
    assert isinstance(err, kt.DeployError) and isinstance(err, TimeoutError)
    msg = str(err)
    assert f"{name}-0" in msg and "launch_timeout=3s" in msg, msg  # what was awaited
    assert "never came up" in msg and "pod-0.log" in msg, msg  # what arrived, where to look
    assert "raise launch_timeout" in msg, msg  # what to try
    # nothing of the failed launch keeps running, and the name is free for a good deploy
    assert _servers_of(name) == []
    remote = kt.fn(fm.rank_of, name=name).to(kt.Compute(cpus=1).distribute("pytorch", workers=2))
    try:
        assert remote() == [0, 1]
    finally:
        remote.teardown()


@pytest.mark.timeout(120)
def test_launch_timeout_is_one_deadline_and_says_which_pods_came_up(tmp_path, monkeypatch) -> None:
    # pod 0 comes up, pod 1 never does. The property is checked on the waits themselves, not
    # on the time .to() took (which a loaded machine stretches): every pod's readiness wait
    # is given the same deadline, launch_timeout after the launch began, and the error comes
    # no earlier than that deadline. One launch_timeout per pod, stacked, gives two deadlines.
    name = "fx-launch-slow"
    # pod 0 must come up within it (half a second on a quiet machine), on a loaded one too
    limit = round(5.0 * time_scale(), 1)
    compute = kt.Compute(
        cpus=1, launch_timeout=limit, env={"PYTHONPATH": _site(tmp_path), "FX_HANG_PODS": "1"}
    )
    waits: list[dict[str, float]] = []
    wait_ready = LocalBackend._wait_ready

    def spy(self, spec, ordinal, proc, ready, log, deadline, *rest):
        wait = {"ordinal": ordinal, "deadline": deadline, "began": time.monotonic()}
        waits.append(wait)
        try:
            return wait_ready(self, spec, ordinal, proc, ready, log, deadline, *rest)
        finally:
            wait["ended"] = time.monotonic()

    monkeypatch.setattr(LocalBackend, "_wait_ready", spy)
    t0 = time.monotonic()
    with pytest.raises(kt.LaunchTimeout) as info:
        kt.fn(fm.rank_of, name=name).to(compute.distribute("pytorch", workers=2))
    msg = str(info.value)
    assert [w["ordinal"] for w in waits] == [0, 1], waits
    assert waits[0]["deadline"] == waits[1]["deadline"], (
        f"each pod's wait had a deadline of its own (stacked), not the launch's one: {waits}"
    )
    deadline = waits[0]["deadline"]
    assert t0 + limit <= deadline <= waits[0]["began"] + limit, (
        "the deadline is not launch_timeout from the launch"
    )
    assert waits[1]["ended"] >= deadline, "LaunchTimeout came before launch_timeout had passed"
    assert f"{name}-1" in msg and f"launch_timeout={limit:g}s" in msg, msg
    assert f"1 of 2 pods were ready: {name}-0" in msg, (
        f"the error does not say that pod 0 came up: {msg}"
    )
    assert _servers_of(name) == []


# ---- quorum ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_worker_pod_gone_before_the_call_is_started_again_and_the_call_runs_on_every_rank(
    deployment, tmp_path
) -> None:
    # as on a cluster, where a deleted pod is replaced: the coordinator cannot reach pod 1, the
    # client sees it gone, starts it again, pushes the code and sends the call, which no rank
    # had started (a stopped pod, alive but silent, is the quorum timeout below)
    remote = _fresh()
    assert remote(str(tmp_path), "warm", 0) == [0, 1]  # the coordinator knows pod 1
    pid = remote.status()[1]["server_pid"]
    url = fm.local_state(NAME)["urls"][1]
    os.kill(pid, signal.SIGKILL)
    assert fm.wait_for(lambda: not fm.pid_alive(pid), 5.0)
    # gone from the network too: its last thread has exited and closed its sockets (the
    # process shows as a zombie a moment before: a call then finds pod 1 vanish mid-call)
    assert fm.wait_for(lambda: fm.refuses(url), 5.0)
    quorum = COMPUTE.distributed.quorum_timeout
    t0 = time.monotonic()
    assert remote(str(tmp_path), "q", 0) == [0, 1]
    took = time.monotonic() - t0
    fm.report(
        "quorum: worker pod killed before the call -> restarted, call runs", took, quorum + 10
    )
    assert remote.status()[1]["server_pid"] != pid
    assert remote(str(tmp_path), "after", 0) == [0, 1]


@pytest.mark.timeout(60)
def test_quorum_timeout_when_a_worker_pod_is_stopped(deployment, stopped, tmp_path) -> None:
    remote = _fresh()
    assert remote(str(tmp_path), "warm", 0) == [0, 1]
    pid = remote.status()[1]["server_pid"]
    stopped.append(pid)
    os.kill(pid, signal.SIGSTOP)
    # A connection that carried a response within PROBE_AFTER_S is trusted without a round
    # trip (a /health probe per call would cost back-to-back calls ~30%); a pod that hangs
    # inside that window is caught by the 10 s silence rule instead. Past it, the quorum
    # probes: a stopped pod fails the quorum and nothing runs.
    time.sleep(PROBE_AFTER_S + 0.3)
    quorum = COMPUTE.distributed.quorum_timeout
    t0 = time.monotonic()
    with pytest.raises(kt.RemoteError) as info:
        remote(str(tmp_path), "q", 5)
    took = time.monotonic() - t0
    fm.report("quorum: worker pod stopped before the call -> error", took, quorum + SLACK_S)
    os.kill(pid, signal.SIGCONT)
    msg = str(info.value)
    assert f"pod {NAME}-1" in msg, msg
    remote = _fresh()  # resumed, the pod serves again
    assert remote(str(tmp_path), "after", 0) == [0, 1]
    # the known gaps, last (see the xfail reason); rank 1 is not checked: its pod, resumed,
    # may find the request that reached it while stopped
    _no_rank_started(tmp_path, "q", ranks=[0])
    # the quorum wait ended it (the pod stays stopped until after the error)
    assert isinstance(info.value, kt.QuorumTimeout), repr(info.value)
    assert f"quorum_timeout={quorum:g}s" in msg, msg


# ---- call ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_call_timeout_option_names_the_ranks_still_running(deployment, tmp_path) -> None:
    remote = _fresh()
    limit = 1.5
    t0 = time.monotonic()
    with pytest.raises(kt.CallTimeout) as info:
        remote.options(timeout=limit)(str(tmp_path), "t", 30, quick=[0])  # rank 0 returns at once
    took = time.monotonic() - t0
    fm.report("call: options(timeout=1.5) -> CallTimeout", took, limit + SLACK_S)
    assert limit <= took  # and the CallTimeout, not rank 1's 30 s of work, ended it
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, kt.RemoteError)
    msg = str(err)
    assert f"rank 1 on pod {NAME}-1" in msg and "timeout of 1.5s" in msg, (
        msg
    )  # awaited, still running
    assert "finished: rank(s) 0" in msg, msg  # what arrived
    assert "to try" in msg and "timeout" in msg.split("to try", 1)[1], msg  # what to try
    assert err.results == {0: 0} and err.failed_ranks == [1]
    assert [f.kind for f in err.failures] == ["timeout"]
    # the rank that ran past the limit is stopped, not left running
    last = fm.last_beat_after_quiet(tmp_path, "t", 1, quiet=1.0, timeout=40)
    assert last is not None, "rank 1 still runs 40 s after the timeout"
    first = fm.starts(tmp_path, "t", 1)[0][1]
    assert last < first + 30 - 5, "rank 1 beat to the end of its 30 s: the timeout did not stop it"
    fm.report("call: options(timeout=1.5) -> rank 1 stops", last - t0, limit + SLACK_S)
    # interrupted, not killed: the rank keeps its process and state
    assert all(fm.pid_alive(p) for p, _ in fm.starts(tmp_path, "t", 1))
    assert remote(str(tmp_path), "after", 0) == [0, 1]


@pytest.mark.timeout(60)
def test_call_timeout_default_is_no_limit_and_deployment_default_is_overridable(
    deployment, tmp_path
) -> None:
    remote = _fresh()
    t0 = time.monotonic()
    assert remote(str(tmp_path), "long", 3.0) == [0, 1]  # no limit unless one is set
    assert time.monotonic() - t0 >= 3.0
    # a per-deployment default, from Compute(call_timeout=...)
    limited = _fresh(dataclasses.replace(COMPUTE, call_timeout=1.5))
    t0 = time.monotonic()
    with pytest.raises(kt.CallTimeout, match=r"timeout of 1\.5s"):
        limited(str(tmp_path), "dflt", 30)
    took = time.monotonic() - t0
    fm.report("call: Compute(call_timeout=1.5) -> CallTimeout", took, 1.5 + SLACK_S)
    assert took >= 1.5  # and the CallTimeout, not the ranks' 30 s of work, ended it
    # ... that a per-call option overrides
    assert limited.options(timeout=10)(str(tmp_path), "over", 2.0) == [0, 1]


# ---- teardown --------------------------------------------------------------------------------


def _stuck_deployment(
    name: str, compute: kt.Compute, d: Path
) -> tuple[kt.RemoteFunction, list[int], list[int], fm.Call]:
    """A deployment busy with a call whose pod servers are SIGSTOPped (SIGTERM stays pending)."""
    remote = kt.fn(fm.beat, name=name).to(compute)
    servers = [pod["server_pid"] for pod in remote.status()]
    call = fm.Call(remote, str(d), "busy", 60)
    assert fm.wait_for(lambda: fm.all_beating(d, "busy", range(2)), 30)
    ranks = [pid for r in range(2) for pid, _ in fm.starts(d, "busy", r)]
    for pid in servers:
        os.kill(pid, signal.SIGSTOP)
    return remote, servers, ranks, call


def _assert_gone(name: str, servers: list[int], ranks: list[int], call: fm.Call, what: str) -> None:
    assert not [p for p in servers if fm.pid_alive(p)], "pod servers survived teardown"
    # a rank process notices that its server is gone (it polls every 0.5 s) and exits
    t0 = time.monotonic()
    assert fm.wait_for(lambda: not any(fm.pid_alive(p) for p in ranks), 30.0), (
        f"rank processes {[p for p in ranks if fm.pid_alive(p)]} survived teardown"
    )
    fm.report(f"{what}: rank processes gone after teardown returned", time.monotonic() - t0, 2.0)
    assert name not in [row["name"] for row in LocalBackend.shared().list()]
    assert not (Path(os.environ["KTLITE_HOME"]) / "local" / name).exists()
    assert call.join(15), "the call still waits after its deployment was torn down"
    assert isinstance(call.error, kt.KtliteError), repr(call.error)


@pytest.mark.timeout(60)
def test_teardown_timeout_kills_pods_that_ignore_sigterm(tmp_path) -> None:
    name = "fx-teardown"
    compute = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2)
    remote, servers, ranks, call = _stuck_deployment(name, compute, tmp_path)
    try:
        t0 = time.monotonic()
        remote.teardown(timeout=2)
        took = time.monotonic() - t0
        fm.report("teardown(timeout=2) of stopped pods", took, 2 + SLACK_S)
        assert took >= 2  # the stopped pods never end on SIGTERM: the timeout's kill did it
        _assert_gone(name, servers, ranks, call, "teardown(timeout=2)")
    finally:
        fm.release(servers)
        LocalBackend.shared().teardown(name, timeout=2)


@pytest.mark.timeout(60)
def test_teardown_timeout_from_compute(tmp_path) -> None:
    name = "fx-teardown-dflt"
    compute = kt.Compute(cpus=1, stream_logs=False, teardown_timeout=1.5).distribute(
        "pytorch", workers=2
    )
    remote, servers, ranks, call = _stuck_deployment(name, compute, tmp_path)
    try:
        t0 = time.monotonic()
        remote.teardown()
        took = time.monotonic() - t0
        fm.report(
            "teardown() with Compute(teardown_timeout=1.5) of stopped pods", took, 1.5 + SLACK_S
        )
        assert took >= 1.5  # the stopped pods never end on SIGTERM: the timeout's kill did it
        _assert_gone(name, servers, ranks, call, "Compute(teardown_timeout=1.5)")
    finally:
        fm.release(servers)
        LocalBackend.shared().teardown(name, timeout=2)
