"""A member's ``RUN`` on a one-rank pod started in the callback that read it and answered in the
one that read its rank's reply (``PodCalls.run_now``), and the calls it leaves to ``Pod.run``
(the general path: a task, admission, heals): a real pod server (uvicorn, the pod server's
app) with a real rank process, the RUNs sent over a real link as pod 0 sends them
(``memberanswer``). ``Pod.run`` is wrapped to record which calls took the general path."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from served_app import Served

from ktlite.net import packaging
from ktlite.net.client import PodClient
from ktlite.net.packaging import bundle
from ktlite_server import linkclient, memberanswer, rankzygote
from ktlite_server.app import create_app
from ktlite_server.keptoutcomes import kept
from ktlite_server.peers import PeerPool
from ktlite_server.pod import Pod
from ktlite_server.ranks import Outcome
from ktlite_wire import codec, frames, linkframes, shm
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER
from ktlite_wire.launch import Launch
from ktlite_wire.outcome import RankOutcome
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

TOKEN = "run-now-test-token"
WAIT_S = 60.0  # a guard against a hang; a deploy takes a second, a call milliseconds
AUTH = {TOKEN_HEADER: f"Bearer {TOKEN}", VERSION_HEADER: str(PROTOCOL_VERSION)}
_count = 0


def act(kind: str, n: int = 0) -> Any:
    """The deployed function: what the rank does for each kind of call."""
    global _count
    if kind == "count":  # how many calls this process ran
        _count += 1
        return _count
    if kind == "print":
        print(f"line {n} from the rank", flush=True)
        return n
    if kind == "raise":
        raise ValueError(f"bad value {n}")
    if kind == "big":
        return b"x" * n
    if kind == "sleep":  # in short sleeps: a stop's interrupt lands between two
        print("sleeping", flush=True)
        deadline = time.monotonic() + n
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return n
    if kind == "exit":
        sys.stdout.flush()
        os._exit(n)
    raise AssertionError(kind)


class _Pod:
    """A served pod with ``act`` deployed; ``general`` lists the calls ``Pod.run`` took."""

    def __init__(self, tmp_path: Path) -> None:
        self.pod = Pod("pod-1", 0)
        self.general: list[str] = []
        run = self.pod.run

        async def recorded(call_id: str, *args: Any, **kwargs: Any) -> Any:
            self.general.append(call_id)
            return await run(call_id, *args, **kwargs)

        self.pod.run = recorded  # type: ignore[method-assign]
        self.served = Served(create_app(self.pod, TOKEN), None, TOKEN)
        launch = Launch(
            launch_id="run-now",
            bundle=bundle(act),
            kind="fn",
            distributed=DistributedLayout(),
            pod_ips=["127.0.0.1"],
            master_port=29500,
            single=True,
        )
        (out,) = PodClient(TOKEN).deploy(self.served.url, launch.encode(), WAIT_S)
        assert out.status is Status.OK, out.message

    async def open(self, pool: PeerPool) -> None:
        """The pool's link to the pod, opened as pod 0 opens it (by a call)."""
        meta = '{"id": "opener", "fanout": false}'
        async with linkclient.post(
            pool, self.served.url, "/call", {CALL_HEADER: meta}, memoryview(b"")
        ) as resp:
            await resp.read()

    def send(
        self,
        pool: PeerPool,
        call_id: str,
        args: tuple[Any, ...],
        sink: Any,
        emit: Any = lambda frame: None,
        told: list[str] | None = None,
        restart: bool = False,
    ) -> memberanswer.MemberAnswer:
        """A RUN of ``act(*args)`` sent as pod 0 sends it; its answer goes to ``sink``."""
        fields = linkframes.run_fields(call_id, "", 0, None, True, restart, True)
        body = memoryview(b"".join(bytes(p) for p in packaging.encode_call(None, args, {})))

        def failed(message: str, status: Status, lost: bool) -> list[RankOutcome]:
            (told if told is not None else []).append(message)
            return [RankOutcome(0, "pod-1", status, None, message, 0.0)]

        async def again() -> Any:
            raise AssertionError("the RUN was sent again")

        sent = memberanswer.send(
            pool, self.served.url, "pod-1", fields, body, 3600.0, emit, failed, again, sink
        )
        assert sent is not None, "no open link: the RUN was not sent"
        return sent

    def runs(self, *calls: tuple[str, tuple[Any, ...], dict[str, Any]]) -> list[Any]:
        """Each ``(call id, args, flags)`` sent as a RUN, one after the other: its answer (the
        rank's outcome, or what the coordinator made up), its log lines, what it was told."""

        async def run(pool: PeerPool, call_id: str, args: Any, flags: dict[str, Any]) -> Any:
            answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            logs: list[str] = []
            told: list[str] = []

            def emit(frame: bytes) -> None:
                for kind, data in frames.FrameParser().feed(frame):
                    if kind == frames.LOG:
                        logs.append(frames.LogLine.decode(data).text)

            self.send(pool, call_id, args, answered.set_result, emit, told, **flags)
            return await asyncio.wait_for(answered, WAIT_S), logs, told

        async def main() -> list[Any]:
            pool = PeerPool(AUTH)
            await self.open(pool)
            got = [await run(pool, *call) for call in calls]
            await pool.aclose()
            return got

        return asyncio.run(main())

    def idle(self) -> bool:
        """Nothing of a call is left behind: the gate is empty, the rank runs nothing."""
        (rank,) = self.pod.ranks
        return self.pod.gate.active == 0 and not rank.running and rank.busy_since is None

    def stop(self) -> None:
        """The pod's ranks and zygote ended on the server's loop, then the server."""
        loop = self.pod.ranks[0]._loop
        if loop is not None and not loop.is_closed():

            async def down() -> None:
                await self.pod.shutdown()
                rankzygote.reset()

            asyncio.run_coroutine_threadsafe(down(), loop).result(WAIT_S)
        self.served.stop()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[_Pod]:
    pod = _Pod(tmp_path)
    yield pod
    pod.stop()


def _value(outs: list[RankOutcome]) -> Any:
    (o,) = outs
    assert o.status is Status.OK, o.message
    return codec.loads(bytearray(o.data))


def test_a_run_on_an_idle_one_rank_pod_starts_at_once_and_runs_once(served: _Pod) -> None:
    got = served.runs(
        ("c1", ("count",), {}),
        ("c2", ("count",), {}),
        ("c1", ("count",), {}),  # delivered again: it ran once, its outcome is kept
        ("c3", ("count",), {"restart": True}),  # fresh processes: the general path
        ("c4", ("count",), {}),
    )
    values = [_value(answer) for answer, _, _ in got]
    assert values == [1, 2, 1, 1, 2]
    assert served.general == ["c1", "c3"], "only the duplicate and the restart took a task"
    assert list(served.pod.finished)[-4:] == ["c1", "c2", "c3", "c4"]
    assert [c["id"] for c in served.pod.history.snapshot()][-4:] == ["c1", "c2", "c3", "c4"]
    assert served.idle()


def test_its_log_lines_come_before_its_answer_and_a_failure_is_the_ranks(served: _Pod) -> None:
    (printed, logs, _), (raised, _, _) = served.runs(
        ("p", ("print", 7), {}), ("r", ("raise", 3), {})
    )
    assert _value(printed) == 7 and logs == ["line 7 from the rank"]
    (o,) = raised
    assert o.status is Status.ERROR
    info = codec.loads(bytearray(o.data))
    assert info.type_name == "builtins.ValueError" and "bad value 3" in info.message
    assert served.general == [] and served.idle()


def test_a_large_result_is_answered_by_a_task_and_the_pod_stays_on_the_lean_path(
    served: _Pod,
) -> None:
    size = shm.INLINE_MAX + 4096
    (big, _, _), (after, _, _) = served.runs(("b", ("big", size), {}), ("a", ("count",), {}))
    (o,) = big
    assert o.status is Status.OK and o.data.path and o.data.size > size  # handed over by name
    assert _value(after) == 1 and served.general == [] and served.idle()


def test_a_rank_that_dies_in_a_run_is_reported_and_replaced_before_the_next(
    served: _Pod,
) -> None:
    (died, _, _), (healed, _, _), (lean, _, _) = served.runs(
        ("d", ("exit", 7), {}), ("h", ("count",), {}), ("l", ("count",), {})
    )
    (o,) = died
    assert o.status is Status.DIED and "exited with code 7" in o.message
    assert _value(healed) == 1 and _value(lean) == 2  # a fresh process
    assert served.general == ["h"], "the call after a death waits for its heal, the next not"
    assert served.idle()


def test_a_run_whose_coordinator_stops_waiting_is_interrupted_on_its_rank(served: _Pod) -> None:
    async def main() -> list[Outcome]:
        pool = PeerPool(AUTH)
        await served.open(pool)
        logs: list[bytes] = []
        sent = served.send(pool, "s", ("sleep", 3600), lambda answer: None, logs.append)
        while not logs:  # the call runs in the rank (bounded: the test's timeout)
            await asyncio.sleep(0.01)
        sent.cancel()  # the stream is closed: the member stops the call (CLOSE)
        while "s" not in served.pod.finished:
            await asyncio.sleep(0.01)
        await pool.aclose()
        return kept(served.pod.finished["s"])

    pid = served.pod.ranks[0].pid
    (o,) = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert o.status is Status.CANCELLED and o.message == "the caller disconnected"
    assert served.general == [] and served.idle()
    ((answer, _, _),) = served.runs(("n", ("count",), {}))
    assert _value(answer) == 1 and served.pod.ranks[0].pid == pid  # interrupted, not killed
