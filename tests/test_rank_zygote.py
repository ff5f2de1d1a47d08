"""Rank processes forked from the pod server's zygote (``ktlite_server.rankzygote``): real
rank processes driven by real ``RankProcess`` handles, no HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from ktlite_server import rankzygote
from ktlite_server.rankgather import Arrivals
from ktlite_server.ranks import RankGone, RankProcess
from ktlite_wire import codec, rankchannel

pytestmark = pytest.mark.skipif(not rankzygote.available(), reason="needs os.fork and pidfds")
LONG = 60.0


@pytest.fixture(autouse=True)
def _fresh_zygote() -> None:
    """Each test starts with no zygote and none lost: every earlier test in this process that
    started ranks on its own event loop counted as a lost zygote (``rankzygote.shared``), and
    after MAX_STARTS of them ranks were exec'd, not forked (seen with test_rank_doorbell.py and
    test_rank_output.py before this file in one worker)."""
    rankzygote.reset()


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def _load(rank: RankProcess, fn: Any) -> None:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank can't import it
    try:
        bundle = cloudpickle.dumps(fn)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    loaded = await rank.load(rankchannel.Load(env={}, bundle=bundle), LONG)
    assert loaded.ok, codec.loads(bytearray(loaded.error or b""))


async def _call(rank: RankProcess, *args: Any, call_id: str = "c1") -> Any:
    data = codec.dumps((None, args, {}))
    result = await asyncio.wait_for(
        rank.call(rankchannel.Call(call_id, data, size=len(data))), LONG
    )
    value = codec.loads(bytearray(result.inline or b""))
    if not result.ok:
        raise AssertionError(f"the call failed: {value}")
    return value


def _run(
    n: int, body: Callable[[list[RankProcess]], Awaitable[Any]], env: dict[str, str] | None = None
) -> Any:
    """Start ``n`` ranks with the same environment (the pod's), run ``body``, kill them."""

    async def main() -> Any:
        lines: list[str] = []
        ranks = [
            RankProcess(i, dict(env or os.environ), lambda r, s, line: lines.append(line))
            for i in range(n)
        ]
        try:
            await asyncio.gather(*(r.start(LONG) for r in ranks))
            return await body(ranks)
        finally:
            for r in ranks:
                r.kill()
            await asyncio.gather(*(r.wait_dead(LONG) for r in ranks))
            rankzygote.reset()
            await asyncio.sleep(0)

    return asyncio.run(main())


def _who() -> tuple[int, int, list[str], float]:
    import random

    return os.getpid(), os.getppid(), list(sys.argv), random.random()


def test_a_pods_ranks_are_forked_from_one_zygote_the_pod_server_started() -> None:
    async def body(ranks: list[RankProcess]) -> tuple[list[Any], list[tuple[bytes, int]]]:
        for r in ranks:
            await _load(r, _who)
        got = [await _call(r) for r in ranks]
        return got, [(_cmdline(g[1]), _parent_of(g[1])) for g in got]

    got, parents = _run(3, body)
    pids = [g[0] for g in got]
    assert len({g[1] for g in got}) == 1, f"the ranks have several parents: {got}"
    cmdline, grandparent = parents[0]
    assert b"ktlite_server.rankzygote" in cmdline and grandparent == os.getpid(), parents
    assert len(set(pids)) == 3
    # each rank is told its own channel (and the bell) as an exec'd rank would be
    assert all(g[2][0].endswith("rank.py") and len(g[2]) == 4 for g in got), got
    # the at-fork reseed: forked ranks draw different random numbers
    assert len({g[3] for g in got}) == 3, got


def test_a_forked_ranks_exit_code_reaches_the_pod_server() -> None:
    async def body(ranks: list[RankProcess]) -> tuple[str, str]:
        await _load(ranks[0], lambda code: os._exit(code))
        with pytest.raises(RankGone) as gone:
            await _call(ranks[0], 7)
        ranks[1].kill()
        await ranks[1].wait_dead(LONG)
        return str(gone.value), ranks[1].death_message()

    exited, killed = _run(2, body)
    assert "rank process exited with code 7" in exited, exited
    assert "rank process was killed by SIGKILL" in killed, killed


def test_a_forked_rank_ends_as_a_python_program_does(tmp_path: Path) -> None:
    """Told to exit, it ends as a rank started with ``python -m ktlite_server.rank`` does:
    its atexit handlers run, and the zygote reports code 0."""
    mark = tmp_path / "atexit-ran"

    def register(path: str) -> int:
        import atexit

        atexit.register(lambda: Path(path).write_text("yes"))
        return os.getpid()

    async def body(ranks: list[RankProcess]) -> tuple[int | None, bool]:
        await _load(ranks[0], register)
        await _call(ranks[0], str(mark))
        await ranks[0]._send(rankchannel.Exit())
        await ranks[0].wait_dead(LONG)
        return ranks[0].exit_code, isinstance(ranks[0].proc, rankzygote.ForkedProcess)

    code, forked = _run(1, body)
    assert forked
    assert code == 0
    assert mark.read_text() == "yes"


def test_a_rank_whose_zygote_dies_is_named_and_the_next_start_gets_a_new_zygote() -> None:
    async def body(ranks: list[RankProcess]) -> tuple[str, int, int]:
        await _load(ranks[0], _who)
        _, zygote, _, _ = await _call(ranks[0])
        os.kill(zygote, signal.SIGKILL)
        await ranks[0].wait_dead(LONG)
        death = ranks[0].death_message()
        fresh = RankProcess(5, dict(os.environ), lambda *_: None)
        await fresh.start(LONG)
        try:
            await _load(fresh, _who)
            _, parent, _, _ = await _call(fresh)
        finally:
            fresh.kill()
            await fresh.wait_dead(LONG)
        return death, zygote, parent

    death, old, new = _run(1, body)
    assert "rank zygote" in death and "lost" in death, death
    assert new != old and new != os.getpid()


def test_the_rank_zygote_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KTLITE_RANK_ZYGOTE", "0")

    async def body(ranks: list[RankProcess]) -> tuple[int, bool]:
        await _load(ranks[0], _who)
        _, parent, _, _ = await _call(ranks[0])
        return parent, isinstance(ranks[0].proc, subprocess.Popen)

    parent, popen = _run(1, body)
    assert parent == os.getpid() and popen


def test_a_rank_with_another_environment_gets_a_zygote_of_its_own_or_a_new_process() -> None:
    """One zygote per environment its ranks start with (a deployment's preload is named in
    it: ``rankpreload``), at most ``MAX_ZYGOTES`` with ranks at once; past that a rank is
    started anew, with its own environment."""

    async def body(ranks: list[RankProcess]) -> list[tuple[int, str | None]]:
        others = [
            RankProcess(i, {**os.environ, "KTLITE_TEST_ODD": str(i)}, lambda *_: None)
            for i in range(1, rankzygote.MAX_ZYGOTES + 1)
        ]
        try:
            for r in others:
                await r.start(LONG)
            out = []
            for r in (ranks[0], *others):
                await _load(r, lambda: (os.getppid(), os.environ.get("KTLITE_TEST_ODD")))
                out.append(await _call(r))
            return out
        finally:
            for r in others:
                r.kill()
                await r.wait_dead(LONG)

    (first, *forked, anew) = _run(1, body)
    assert first[0] != os.getpid() and first[1] is None  # forked
    assert [f[1] for f in forked] == [str(i) for i in range(1, len(forked) + 1)]
    parents = {first[0], *(f[0] for f in forked)}
    assert len(parents) == rankzygote.MAX_ZYGOTES and os.getpid() not in parents
    assert anew == (os.getpid(), str(rankzygote.MAX_ZYGOTES))  # started anew


def test_a_forked_ranks_output_reaches_the_pod_before_its_result() -> None:
    def shout(tag: str) -> str:
        print(f"{tag} on stdout")
        os.write(2, f"{tag} on stderr by the fd\n".encode())
        return tag

    async def main() -> tuple[list[str], str]:
        lines: list[str] = []
        rank = RankProcess(0, dict(os.environ), lambda r, s, line: lines.append(f"{s}:{line}"))
        try:
            await rank.start(LONG)
            assert isinstance(rank.proc, rankzygote.ForkedProcess)
            await _load(rank, shout)
            data = codec.dumps((None, ("hi",), {}))
            arrivals = Arrivals("c1", [(rank, rankchannel.Call("c1", data, size=len(data)))])
            (reply,) = await asyncio.wait_for(arrivals.next(), LONG)  # its output read first
            result = reply.rank.check(reply.msg.id, reply.result())
            return list(lines), codec.loads(bytearray(result.inline or b""))
        finally:
            rank.kill()
            await rank.wait_dead(LONG)
            rankzygote.reset()

    lines, value = asyncio.run(main())
    assert value == "hi"
    assert "out:hi on stdout" in lines and "err:hi on stderr by the fd" in lines, lines


def test_the_zygote_exits_with_its_pod_server() -> None:
    """A pod server killed outright (no teardown): its zygote sees the socket's EOF and
    leaves, and so do the ranks it forked (they watch their parent)."""
    code = (
        "import asyncio, os, sys\n"
        "from ktlite_server.ranks import RankProcess\n"
        "async def main():\n"
        "    r = RankProcess(0, dict(os.environ), lambda *_: None)\n"
        "    await r.start(60)\n"
        "    print(r.pid, os.getpid(), flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    with tempfile.TemporaryDirectory() as d:
        server = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=d, text=True
        )
        try:
            assert server.stdout is not None
            rank_pid, server_pid = (int(x) for x in server.stdout.readline().split())
            zygote = _parent_of(rank_pid)
            assert zygote != server_pid and _parent_of(zygote) == server_pid
        finally:
            server.kill()
            server.wait(LONG)
            if server.stdout is not None:
                server.stdout.close()
        for pid in (zygote, rank_pid):
            _wait_gone(pid)


def _wait_gone(pid: int) -> None:
    """Until ``pid`` is gone (or a zombie nobody reaps yet), bounded."""
    import time

    deadline = time.monotonic() + LONG
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":
            return
        time.sleep(0.05)  # a process another one ends, polled with a bound
    raise AssertionError(f"process {pid} outlived its pod server by {LONG:.0f} s")


def test_a_zygote_replaced_for_a_new_event_loop_is_not_counted_lost() -> None:
    """A process that runs several event loops one after another (tests, a restarted loop)
    gets a zygote on each; only zygotes that failed count against ``MAX_LOST``."""

    async def one() -> bool:
        rank = RankProcess(0, dict(os.environ), lambda *_: None)
        try:
            await rank.start(LONG)
            return isinstance(rank.proc, rankzygote.ForkedProcess)
        finally:
            rank.kill()
            await rank.wait_dead(LONG)

    rankzygote.reset()
    try:
        forked = [asyncio.run(one()) for _ in range(rankzygote.MAX_LOST + 2)]
    finally:
        rankzygote.reset()
    assert forked == [True] * (rankzygote.MAX_LOST + 2), forked
