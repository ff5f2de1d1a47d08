"""The warm files a pod keeps, within one budget for the whole pod (``ktlite_wire.keepbudget``):
its server's argument files and every rank's result files together, never more than the
budget; shared through a ledger its processes count in (``keepledger``); idle files removed
after a while; and each process's own (a forked child keeps files of its own and leaves its
parent's alone, also at its exit: ``perprocess``).

Real pods of the local backend (four rank processes on one pod, over HTTP and on the caller's
host), a real ledger shared by forked processes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

import ktlite as kt
from ktlite_server import resultfiles
from ktlite_wire import argfiles, keepbudget, shm
from ktlite_wire.keepbudget import OwnBudget
from ktlite_wire.keepledger import Ledger

MiB = 1 << 20
N = 3 << 18  # float32s: 3 MiB, past shm.INLINE_MAX
BUDGET_MB = 8  # two of the four ranks' results fit, not four


class Echo:
    def echo(self, x: np.ndarray) -> tuple[int, int, np.ndarray]:
        return os.getpid(), os.getppid(), x + 1


@pytest.fixture(scope="module")
def four() -> Iterator[object]:
    compute = kt.Compute(stream_logs=False, env={keepbudget.KEEP_ENV: str(BUDGET_MB)})
    remote = kt.cls(Echo).to(
        compute.distribute("spmd", workers=1, num_proc=4), name="keep-budget-four"
    )
    yield remote
    remote.teardown()


def _kept_bytes(ranks: set[int], server: int) -> int:
    """The bytes of the pod's kept files in /dev/shm: its ranks' result files (under any of
    their names) and the argument files its server holds free (open: found by its fds)."""
    marks = tuple(
        p + resultfiles.kept_prefix(pid).removeprefix(shm.RESULT_PREFIX)
        for pid in ranks
        for p in shm.KEPT_PREFIXES
    )
    held = 0
    for name in os.listdir(shm.shm_dir()):
        if name.startswith(marks):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                held += os.path.getsize(os.path.join(shm.shm_dir(), name))
    fds = f"/proc/{server}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(os.path.join(fds, fd))
        except OSError:
            continue
        if os.path.basename(target).startswith(argfiles.FREE_PREFIX):
            held += os.path.getsize(target)
    return held


@pytest.mark.parametrize("shm_path", ["0", "1"], ids=["http", "same-host"])
def test_a_pod_of_four_ranks_keeps_no_more_than_its_budget(
    four, shm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KTLITE_SHM", shm_path)
    x = np.zeros(N, dtype=np.float32)
    ranks: set[int] = set()
    servers: set[int] = set()
    most = 0
    for v in range(6):
        x[:] = v
        got = four.echo(x)
        assert [float(a.min()) for _, _, a in got] == [v + 1.0] * 4
        ranks |= {pid for pid, _, _ in got}
        servers |= {ppid for _, ppid, _ in got}
        del got  # nothing of this process maps the results' files any more
        most = max(most, _kept_bytes(ranks, *servers))
    assert len(ranks) == 4 and len(servers) == 1
    # before the budget was the pod's, each rank kept its own 8 MiB: 4 x 3 MiB and more
    assert 0 < most <= BUDGET_MB * MiB, f"the pod kept {most} bytes, its budget {BUDGET_MB} MiB"


def test_a_ledger_is_one_count_for_every_process_of_the_pod() -> None:
    ledger = Ledger.create(10 * MiB)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a rank: it keeps 6 MiB and dies without giving them back
            try:
                child = Ledger(ledger.path)
                os.write(write, b"y" if child.reserve(6 * MiB) else b"n")
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as r:
            assert r.read() == b"y"
        os.waitpid(pid, 0)
        assert ledger.held() == 6 * MiB
        assert not ledger.reserve(6 * MiB)  # 12 MiB: over the pod's 10
        assert ledger.reserve(4 * MiB)
        ledger.forget(pid)  # its pod server saw it die (its files removed)
        assert ledger.held() == 4 * MiB and ledger.reserve(6 * MiB)
        ledger.give(10 * MiB)
        assert ledger.held() == 0
        assert not ledger.reserve(11 * MiB)  # more than the whole budget: never
    finally:
        ledger.remove()
    assert not os.path.exists(ledger.path)


def test_a_pod_budget_is_a_share_of_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert keepbudget.derive(None, None) == 256 * MiB
    assert keepbudget.derive(1 << 30, None) == 128 * MiB  # an eighth of a 1 GiB limit
    assert keepbudget.derive(64 << 30, 200 * MiB) == 50 * MiB  # a quarter of /dev/shm
    assert keepbudget.derive(64 << 30, 64 << 30) == 256 * MiB  # at most 256 MiB
    monkeypatch.setenv(keepbudget.KEEP_ENV, "0")
    assert keepbudget.pod_budget() == 0
    monkeypatch.setenv(keepbudget.KEEP_ENV, "lots")
    with pytest.raises(ValueError, match="KTLITE_RECEIVE_KEEP_MB='lots'"):
        keepbudget.pod_budget()


def test_idle_argument_files_are_removed_after_a_while() -> None:
    budget = OwnBudget(16 * MiB)
    files = argfiles.ArgFiles(budget, remove=os.unlink, idle_s=60.0)
    try:
        f = files.take(4 * MiB)
        assert f.kept and budget.held() == 4 * MiB
        files.give_back(f, reusable=True)
        free = argfiles._free_name(f.path)
        assert files.expire(now=f.used + 30) and os.path.exists(free)  # not idle long enough
        assert not files.expire(now=f.used + 61)
        assert not os.path.exists(free) and budget.held() == 0
    finally:
        files.clear()


def test_idle_result_files_are_removed_after_a_while_unless_in_flight() -> None:
    budget = OwnBudget(16 * MiB)
    files = resultfiles.ResultFiles(budget, idle_s=60.0)
    try:
        fd, taken = files.create(2 * MiB)
        os.close(fd)
        fd, in_flight = files.create(2 * MiB)  # a result its pod server has not taken yet
        os.close(fd)
        shm.take(taken, 2 * MiB).release()
        assert budget.held() == 4 * MiB
        later = files._files[-1].used + 61
        assert files.expire(now=later)  # the one in flight stays
        assert not os.path.exists(shm.took_path(taken)) and os.path.exists(in_flight)
        assert budget.held() == 2 * MiB
    finally:
        files.clear()
    assert budget.held() == 0 and not os.path.exists(in_flight)


def test_a_forked_child_leaves_its_parents_kept_files_alone(tmp_path) -> None:
    """The child keeps files of its own (a fresh set, not its parent's, which the parent may
    write again), and its exit removes those only."""
    script = textwrap.dedent(
        """
        import os, sys
        from ktlite_wire import argfiles
        f = argfiles.process().take(2 << 20)
        argfiles.process().give_back(f, reusable=True)
        free = argfiles._free_name(f.path)
        pid = os.fork()
        if pid == 0:
            mine = argfiles.process()
            g = mine.take(2 << 20)
            print("child-own" if not g.warm else "child-took-the-parent's", flush=True)
            mine.give_back(g, reusable=True)
            sys.exit(0)  # a normal exit: its exit handlers run
        os.waitpid(pid, 0)
        print("kept" if os.path.exists(free) else "removed by the child", flush=True)
        """
    )
    env = {**os.environ, "KTLITE_RECEIVE_KEEP_MB": "16"}
    env.pop("KTLITE_KEEP_LEDGER", None)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child-own", "kept"]


def test_idle_files_go_on_their_own() -> None:
    """The expiry thread removes a free file once it has been idle (here 0.2 s)."""
    budget = OwnBudget(16 * MiB)
    files = argfiles.ArgFiles(budget, remove=os.unlink, idle_s=0.2)
    f = files.take(2 * MiB)
    files.give_back(f, reusable=True)
    free = argfiles._free_name(f.path)
    deadline = time.monotonic() + 30
    while os.path.exists(free) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the thread's work, bounded
    assert not os.path.exists(free), "an idle free file was still kept after 30 s"
    assert budget.held() == 0


def test_the_ledger_of_a_killed_pod_server_is_removed_by_the_next() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a pod server killed before its exit handlers ran
        try:
            os.write(write, Ledger.create(MiB).path.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        stale = r.read().decode()
    os.waitpid(pid, 0)
    assert os.path.exists(stale)
    ledger = Ledger.create(MiB)
    try:
        assert not os.path.exists(stale) and os.path.exists(ledger.path)
    finally:
        ledger.remove()
