"""A rank that runs in its pod server's own process: the stand-in ``bench_scale.py`` puts
behind the seam real rank processes use (``ktlite_server.pod.Pod.rank_type``).

It keeps the rank runtime's contract (``ktlite_server.rank``): a ``Load`` answered with
``Loaded``, a ``Call`` decoded with the same codec (per-rank items filled in), the user's
function run, its value (or the exception's info) encoded and answered as a ``Result``,
printed lines handed to the pod as the rank's output, an interrupt stopping an ``async def``
call, a kill ending the rank. What it does not have is a process: no fork, no pipes, no
socketpair, no process group (``torch.distributed``), no ``os.environ`` of its own (every
rank of a host shares one), and a call runs inline on the server's event loop (an ``async
def`` one as a task on it), so it costs only its own work.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import io
import os
import pickle
import sys
from typing import Any

from ktlite_server.pod import Pod
from ktlite_server.rank import exception_info
from ktlite_server.ranks import RankGone, RankProcess
from ktlite_wire import codec, rankchannel, rankdata, shm

# the loaded callables of this host's ranks, by bundle: every rank of a launch loads the same
_LOADED: dict[bytes, Any] = {}
# the rank whose call runs now (an async call's task keeps it): where its printed lines go
_RANK: contextvars.ContextVar[SimRank | None] = contextvars.ContextVar("sim_rank", default=None)


class _RankOutput(io.TextIOBase):
    """This process's stdout: a line printed inside a rank's call is that rank's output (a
    real rank's stdout pipe); anything else goes to the real stdout."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def write(self, text: str) -> int:
        rank = _RANK.get()
        if rank is None:
            return int(self.real.write(text))
        rank.partial += text
        *lines, rank.partial = rank.partial.split("\n")
        for line in lines:
            rank.on_log(rank, "out", line)
        return len(text)

    def flush(self) -> None:
        self.real.flush()


class SimRank(RankProcess):
    """A rank process's handle whose 'process' is this one (see the module docstring)."""

    def __init__(self, local_rank: int, env: dict[str, str], on_log: Any) -> None:
        super().__init__(local_rank, env, on_log)
        self.target: Any = None
        self.partial = ""  # a line printed in part
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self._dead.is_set()

    @property
    def pid(self) -> int | None:
        return os.getpid()

    async def start(self, timeout: float = 60.0) -> None:
        return None  # nothing to start: the rank lives in this process

    def kill(self) -> None:
        if self._dead.is_set():
            return
        self.stopping = True
        self.exit_code = -9
        for task in self._tasks.values():
            task.cancel()
        self._dead.set()

    def death_message(self) -> str:
        return "simulated rank was stopped"

    async def load(self, msg: rankchannel.Load, timeout: float) -> rankchannel.Loaded:
        if not self.alive:
            raise RankGone(self.death_message())
        try:
            bundle = bytes(msg.bundle or b"")
            fn = _LOADED.get(bundle)
            if fn is None:
                fn = _LOADED[bundle] = pickle.loads(bundle)
            if msg.kind == "cls":
                args, kwargs = codec.loads(msg.init) if msg.init is not None else ((), {})
                fn = fn(*args, **kwargs)
            self.target = fn
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            return rankchannel.Loaded(False, codec.dumps(exception_info(exc)))
        self.loaded_env = dict(msg.env)
        return rankchannel.Loaded(True, None)

    def send(self, msg: rankchannel.Call, reply: Any, frame: Any = None, ring: bool = True) -> None:
        """A call sent with others, its reply gathered (``rankgather``): a task of its own."""

        def done(task: asyncio.Task[rankchannel.Result]) -> None:
            if task.cancelled():
                reply.set_exception(RankGone(self.death_message()))
            elif task.exception() is not None:
                reply.set_exception(task.exception())
            else:
                reply.set_result(task.result())

        asyncio.get_running_loop().create_task(self.call(msg)).add_done_callback(done)

    async def call(self, msg: rankchannel.Call) -> rankchannel.Result:
        if not self.alive:
            raise RankGone(self.death_message())
        payload = msg.args if msg.args is not None else shm.map_private(msg.path or "", msg.size)
        running = _RANK.set(self)
        try:
            method, args, kwargs = codec.loads(payload)
            if msg.item is not None:
                args, kwargs = rankdata.fill(args, kwargs, codec.loads(bytearray(msg.item)))
            fn = self.target if method is None else getattr(self.target, method)
            value = fn(*args, **kwargs)
            if inspect.iscoroutine(value):
                task = asyncio.get_running_loop().create_task(value)
                self._tasks[msg.id] = task
                try:
                    value = await task
                finally:
                    self._tasks.pop(msg.id, None)
            ok = True
        except asyncio.CancelledError as exc:  # interrupted: what CallInterrupted is to a rank
            if not self.alive:
                raise RankGone(self.death_message()) from None
            ok, value = False, exception_info(exc)
        except Exception as exc:  # noqa: BLE001 - the user's error goes back to the caller
            ok, value = False, exception_info(exc)
        finally:
            _RANK.reset(running)
        parts = codec.dumps_parts(value)
        inline = b"".join(parts)
        return rankchannel.Result(msg.id, ok, inline, None, len(inline), False, False)

    def interrupt_main(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    async def interrupt(self, call_id: str) -> None:
        task = self._tasks.get(call_id)
        if task is not None:
            task.cancel()

    def drain_output(self) -> None:
        return None


class SimPod(Pod):
    """A pod whose ranks are :class:`SimRank` s; everything else is the real pod runtime."""

    rank_type = SimRank

    def __init__(self, name: str, ordinal: int, procs: int = 1) -> None:
        super().__init__(name, ordinal, procs)
        if not isinstance(sys.stdout, _RankOutput):
            sys.stdout = _RankOutput(sys.stdout)
