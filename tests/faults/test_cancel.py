"""Issue 4, point 5: Ctrl-C in the caller, or the caller's process dying, stops the call's
rank processes on every pod within seconds, and the deployment stays usable.

The caller is a real second Python process (``CALLER`` below) that attaches to this
module's detached deployment by name, as ``ktlite deploy``d services are called from other
processes, and runs a long call; the test sends it SIGINT or SIGKILL. Its ranks write a
heartbeat line every 50 ms (``faults_mod.beat``): a rank stopped when its lines stop.

No check is a wall-clock bound (the suite runs on busy machines too); the times are reported
(``pytest -s``). That the signal, not the call's end, stopped a rank is read from its lines:
they stop long before the ``CALL_S`` it would have beaten for. That Ctrl-C interrupts at once,
not after the coordinator's silence is noticed, is read from the caller, whose silence timeout
is set far above the time a hang takes to fail the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults_mod as fm
import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite_wire.heartbeat import SILENCE_ENV

NAME = "fx-cancel"
COMPUTE = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2, num_proc=2)
RANKS = range(4)
INTERRUPT_BOUND_S = (
    2.0  # KeyboardInterrupt reaches the caller's code (reported, on a quiet machine)
)
STOP_BOUND_S = 3.0  # "within seconds": every rank of the call has stopped (reported likewise)
CALL_S = 60  # how long the caller's call would run if nothing stopped it
WAIT_S = 30  # a guard against a hang: the caller's process ends, a rank stops, within this

CALLER = """
import signal
import sys
import time

# Ctrl-C as in a terminal, even when this test runs where SIGINT is ignored (a background job
# of a shell inherits SIG_IGN, and so does every process it starts)
signal.signal(signal.SIGINT, signal.default_int_handler)

faults_dir, name, d, tag, then = sys.argv[1:6]
sys.path.insert(0, faults_dir)
import faults_mod

import ktlite as kt
from ktlite.modes.deploy import attach
from ktlite.api.remote import RemoteFunction
from ktlite.specs.deployment_spec import DeploymentSpec

compute = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2, num_proc=2)
remote = RemoteFunction(kt.fn(faults_mod.beat, name=name),
                        attach(DeploymentSpec(name=name, pod=compute.pod_spec(), kind="fn")),
                        compute=compute)
print("ATTACHED", flush=True)
try:
    remote(d, tag, int(sys.argv[6]))
    print("FINISHED", flush=True)
except KeyboardInterrupt:
    print(f"INTERRUPTED {time.monotonic()}", flush=True)
    if then == "next":  # the same process goes on: its next call works
        print(f"NEXT {remote(d, tag + '-next', 0)}", flush=True)
"""


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(fm.beat, name=NAME).to(COMPUTE, detached=True)
    yield r
    LocalBackend.shared().teardown(NAME, timeout=5.0)


@pytest.fixture
def stopped(remote):
    pids: list[int] = []
    yield pids
    fm.recover(NAME, pids)


def _caller(d: Path, tag: str, then: str = "next") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CALLER,
            str(Path(fm.__file__).parent),
            NAME,
            str(d),
            tag,
            then,
            str(CALL_S),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # the caller would give a stopped coordinator up only after this much silence
        env={**os.environ, SILENCE_ENV: str(10 * WAIT_S)},
    )


def _wait_running(proc: subprocess.Popen[str], d: Path, tag: str) -> None:
    ok = fm.wait_for(lambda: fm.all_beating(d, tag, RANKS) or proc.poll() is not None, 60)
    assert ok and proc.poll() is None, (
        f"the caller never got its call running: {proc.communicate()}"
    )


def _stop_time(d: Path, tag: str, rank: int, t0: float, what: str) -> float:
    """Seconds from ``t0`` to rank ``rank``'s last line, once it stopped; fails if it beat on
    to the end of the call (nothing stopped it) or still beats after WAIT_S."""
    last = fm.last_beat_after_quiet(d, tag, rank, quiet=1.0, timeout=WAIT_S)
    assert last is not None, f"rank {rank} still runs the call {WAIT_S}s after the caller {what}"
    first = fm.starts(d, tag, rank)[0][1]
    assert last < first + CALL_S - 5, f"rank {rank} ran its call to the end: nothing stopped it"
    fm.report(f"caller {what}: rank {rank} stops", max(0.0, last - t0), STOP_BOUND_S)
    return max(0.0, last - t0)


def _assert_stopped(d: Path, tag: str, t0: float, what: str) -> None:
    for r in RANKS:
        _stop_time(d, tag, r, t0, what)
        pids = [pid for pid, _ in fm.starts(d, tag, r)]
        assert len(pids) == 1, f"rank {r} ran the call {len(pids)} times"
        # the call was interrupted, not the process: the rank keeps its state
        assert fm.pid_alive(pids[0]), f"rank {r}'s process was killed instead of interrupted"


def _assert_usable(remote: kt.RemoteFunction, d: Path) -> None:
    assert fm.wait_for(
        lambda: all(
            rank["state"] == "idle" and not pod["active_calls"]
            for pod in remote.status()
            for rank in pod["ranks"]
        ),
        WAIT_S,
    ), remote.status()
    assert remote(str(d), "from-test", 0) == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_caller_stops_every_rank(remote, tmp_path) -> None:
    proc = _caller(tmp_path, "c")
    try:
        _wait_running(proc, tmp_path, "c")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out, err)
    interrupted = [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("INTERRUPTED ")]
    assert interrupted, (out, err)
    took = interrupted[0] - t0
    fm.report("Ctrl-C -> KeyboardInterrupt in the caller", took, INTERRUPT_BOUND_S)
    _assert_stopped(tmp_path, "c", t0, "pressed Ctrl-C")
    assert "NEXT [0, 1, 2, 3]" in out.splitlines(), (out, err)  # the caller's next call works
    _assert_usable(remote, tmp_path)  # and so does this process's


@pytest.mark.timeout(60)
def test_caller_killed_mid_call_stops_every_rank(remote, tmp_path) -> None:
    proc = _caller(tmp_path, "k")
    try:
        _wait_running(proc, tmp_path, "k")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    _assert_stopped(tmp_path, "k", t0, "was killed")
    _assert_usable(remote, tmp_path)


@pytest.mark.timeout(90)
def test_ctrl_c_interrupts_a_call_whose_coordinator_hangs(remote, stopped, tmp_path) -> None:
    """The coordinator pod is stopped mid-call (the call would wait for the caller's silence
    timeout, here 10 × WAIT_S): Ctrl-C still interrupts at once (the caller ends within
    WAIT_S), and pod 1's ranks stop."""
    proc = _caller(tmp_path, "h", then="exit")
    try:
        _wait_running(proc, tmp_path, "h")
        pid = remote.status()[0]["server_pid"]
        stopped.append(pid)
        fm.stop(pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    interrupted = [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("INTERRUPTED ")]
    assert interrupted, (out, err)
    took = interrupted[0] - t0
    fm.report("Ctrl-C with the coordinator stopped -> KeyboardInterrupt", took, INTERRUPT_BOUND_S)
    for r in (2, 3):  # pod 1 is healthy: its ranks stop while the coordinator is still stopped
        _stop_time(tmp_path, "h", r, t0, "pressed Ctrl-C (coordinator stopped)")
    os.kill(pid, signal.SIGCONT)
    t1 = time.monotonic()
    for r in (0, 1):  # resumed, the coordinator finds its caller gone and stops its ranks
        _stop_time(tmp_path, "h", r, t1, "pressed Ctrl-C (coordinator resumed)")
    _assert_usable(remote, tmp_path)
