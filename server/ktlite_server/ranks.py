"""The pod server's handle on one rank process: start, load, call, kill, and notice death.

Death is seen from the process itself (a pidfd, else the control socket's EOF), never by
polling a result forever. stdout/stderr are read from pipes, so output of C extensions
and subprocesses is captured too, and drained before a result is handed on so a call's
last log lines always arrive before its result (``rankoutput``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ktlite_server import doorbell, rankzygote, resultfiles, resultmaps
from ktlite_server.oomkills import killed as oom_killed
from ktlite_server.rankconn import RankConnection
from ktlite_server.rankoutput import RankOutput, pipes
from ktlite_server.rankzygote import ForkedProcess
from ktlite_server.resultfeed import Feed, ResultLost
from ktlite_wire import rankchannel
from ktlite_wire.errors import ProtocolError
from ktlite_wire.status import Status

LogSink = Callable[["RankProcess", str, str], None]


class Waiter(Protocol):
    """What waits for a reply under a key (a future, or a gathered call's ``rankgather.Reply``):
    resolved with the rank's message, or failed with its death."""

    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass
class Outcome:
    """One rank's result of one call, as the server sees it (the value stays opaque bytes)."""

    rank: int
    status: Status
    data: Any = None  # encoded value or RemoteExceptionInfo (bytes / memoryview), opaque here
    message: str = ""
    path: str | None = None  # a large value waits in this shared-memory file instead
    size: int = 0
    feed: Feed | None = None  # the rank still writes that file: how far it got
    holds_args: bool = False  # the rank may still map the call's argument file (argfiles)
    at: float = field(
        default_factory=time.time
    )  # when it was known: the earliest failure is the cause


async def settled(outs: list[Outcome]) -> list[Outcome]:
    """``outs`` once every result a rank still writes is written whole; one whose rank died
    or failed to write it is that rank's death (its file removed)."""
    settled = []
    for o in outs:
        if o.feed is not None:
            try:
                await o.feed.until(o.size)
            except ResultLost as e:
                if o.path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(o.path)
                o = Outcome(o.rank, Status.DIED, message=str(e), at=time.time())
        settled.append(o)
    return settled


class RankGone(Exception):
    """The rank process exited; ``message`` says how, with its last stderr lines."""


def describe_exit(code: int | None, oom: bool = False) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"was killed by {name}"
        if oom:
            text += " (OOM killed)"
        return text
    return f"exited with code {code}"


class RankProcess:
    def __init__(self, local_rank: int, env: dict[str, str], on_log: LogSink) -> None:
        self.local_rank = local_rank
        self.global_rank = local_rank
        self.env = env
        self.on_log = on_log
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.loaded_env: dict[str, str] | None = None
        self.targets: set[str] = set()  # colocated targets loaded in this process
        self.exit_code: int | None = None
        self.last_exit: int | None = None  # how the process this one replaced ended
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.busy_since: float | None = None
        self.running: dict[str, float] = {}  # call id -> when this rank began it (monotonic)
        self.has_pg = False  # torch.distributed state (a group, or a failed init's) lives in it
        self.tainted = False
        self.stopping = False  # we killed it: its death is no crash
        self.restarts = 0
        self.streak = 0  # deaths between calls so far: what max_restarts limits
        self.died_in_call = False  # its death was a call's error (not charged to max_restarts)
        self._conn: RankConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its channel is on
        self.bell: doorbell.Doorbell | None = None  # what the process waits on, if not its channel
        self.alone = False  # the pod's only rank: it waits on its channel (see start())
        self.bit = doorbell.Doorbell.bit(local_rank)
        self._pending: dict[str, Waiter] = {}  # "start", "load" or a call id -> its reply
        self._dead = asyncio.Event()
        self._output = RankOutput(
            lambda stream, line: self.on_log(self, stream, line), self.stderr_tail
        )
        self._heard = -1  # the pipes' drains when its last result was read (rankoutput.Pipes)
        self._pipes = pipes()  # (asked once: every result reads its drain count)
        self._pidfd: int | None = None
        self._oom: bool | None = None  # whether its death was an OOM kill, once known
        self._feeds: dict[str, Feed] = {}  # call id -> a result the rank still writes
        self._streamed: dict[str, Feed] = {}  # ... until the call that awaits it takes it

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self, timeout: float = 60.0) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._oom = None
        parent, child = socket.socketpair()
        env = {**self.env, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "ktlite_server.rank", str(child.fileno())]
        fds = [child.fileno()]
        # a pod's only rank blocks on its channel: a write wakes it as a ring would, and a ring
        # and the rank's wait on it are two system calls a call more (the bell pays off when
        # one ring wakes many ranks)
        self.bell = None if self.alone else doorbell.shared()
        if self.bell is not None:  # the rank waits on it: see ring()
            argv += [str(self.bell.fd), str(self.bit)]
            fds.append(self.bell.fd)
        try:
            self.proc = await self._fork(env, child) or subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=fds,
                env=env,
                start_new_session=True,
            )
        finally:
            child.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._output.attach(loop, self.proc.stdout.fileno(), self.proc.stderr.fileno())
        self._register("start")  # before the channel is read: Ready may come at once
        _, self._conn = await loop.create_unix_connection(
            lambda: RankConnection(self._on_message, self._on_bad, self._on_lost), sock=parent
        )
        if hasattr(os, "pidfd_open") and not isinstance(self.proc, ForkedProcess):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.proc.pid)
                loop.add_reader(self._pidfd, self._on_exit)
        reply = await self._expect(timeout, "start")
        if not isinstance(reply, rankchannel.Ready):
            raise RankGone(f"rank process sent {reply!r} instead of Ready")

    async def _fork(self, env: dict[str, str], child: socket.socket) -> ForkedProcess | None:
        """The rank forked from the pod's zygote (``rankzygote``), or None: start it anew."""
        zygote = rankzygote.shared(env)
        if zygote is None:
            return None
        argv = ["chan"] + (["bell", str(self.bit)] if self.bell is not None else [])
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        proc = None
        try:
            proc = await zygote.spawn(
                argv, child.fileno(), out_w, err_w, self.bell.fd if self.bell else None
            )
        except OSError:
            return None
        finally:
            for fd in (out_w, err_w) if proc is not None else (out_w, err_w, out_r, err_r):
                os.close(fd)
        proc.stdout, proc.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        proc.on_exit = self._on_exit  # the zygote reports its exit code (it is its parent)
        return proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self._dead.is_set()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """SIGKILL the rank and everything it started (its own session)."""
        if self.proc is None or self._dead.is_set():
            return
        if self.proc.poll() is not None:
            return  # it exited on its own: a death to report, not one of our stops
        self.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def wait_dead(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._dead.wait(), timeout)

    # ---- requests ----------------------------------------------------------------------

    async def load(self, msg: rankchannel.Load, timeout: float) -> rankchannel.Loaded:
        self._register("load")
        try:
            await self._send(msg)
        except BaseException:
            self._pending.pop("load", None)
            raise
        reply = await self._expect(timeout, "load")
        if not isinstance(reply, rankchannel.Loaded):
            self.kill()  # out of step with us: never trust its next reply either
            raise RankGone(
                f"rank process answered {type(reply).__name__} to a load; it was restarted"
            )
        if reply.ok:
            self.loaded_env = dict(msg.env)
        return reply

    def send(
        self,
        msg: rankchannel.Call,
        reply: Waiter,
        frame: list[Any] | None = None,
        ring: bool = True,
    ) -> None:
        """Send call ``msg`` (``frame``: it encoded, when one message goes to many ranks)
        without waiting; ``reply`` is resolved with the rank's reply in the callback that read
        it (nothing is scheduled), or failed with RankGone at its death. ``ring=False``: the
        caller rings the doorbell once for many ranks (and released the result maps first:
        ``resultmaps.ResultMaps.release``)."""
        if self.proc is None or self._dead.is_set() or self._conn is None:  # (not alive)
            reply.set_exception(RankGone(self.death_message()))
            return
        self._pending[msg.id] = reply
        if not self._conn.closed:  # else its death, with its exit code, fails the reply
            self._conn.write(frame or rankchannel.frame(msg))
            if ring:
                self.ring()

    def ring(self) -> None:
        """Wake the process for what was written to it (see ``doorbell``)."""
        if self.bell is not None:
            self.bell.ring(self.bit)

    def answer(self, call_id: str, reply: Any) -> rankchannel.Result:
        """The reply :meth:`call` awaited, checked, once the rank's output so far is read (its
        log lines precede its result)."""
        self.drain_output()
        return self.check(call_id, reply)

    def check(self, call_id: str, reply: Any) -> rankchannel.Result:
        """The reply to call ``call_id``, checked (:meth:`answer` without reading the rank's
        output: a gathered call drains every rank's pipes once, ``rankgather``)."""
        if not isinstance(reply, rankchannel.Result) or reply.id != call_id:
            self.kill()  # out of step with us: never trust its next reply either
            raise RankGone(
                f"rank process answered {type(reply).__name__} to call {call_id}; it was restarted"
            )
        self.has_pg = reply.has_pg
        self.tainted = reply.tainted  # interrupted inside an import: the pod replaces it
        return reply

    async def call(self, msg: rankchannel.Call) -> rankchannel.Result:
        """Send call ``msg`` and wait for its reply (a dead rank raises RankGone). The reply's
        future is awaited as it is: no shield (its two done callbacks put the task's wake-up
        two loop passes after the reply) and no done callback of its own (the reader takes
        it off ``_pending``; a cancelled wait takes it off here)."""
        # the loop the channel is on (asking for the running one is a getpid() each)
        future: asyncio.Future[Any] = (self._loop or asyncio.get_running_loop()).create_future()
        resultmaps.server().release()  # result files nothing sends from: the rank may reuse
        self.send(msg, future)
        try:
            reply = await future
        finally:
            if self._pending.get(msg.id) is future:
                del self._pending[msg.id]
        return self.answer(msg.id, reply)

    def feed(self, call_id: str) -> Feed | None:
        """The progress of call ``call_id``'s result while the rank writes it (once, after
        :meth:`call` returned a streaming result)."""
        return self._streamed.pop(call_id, None)

    def interrupt_main(self) -> None:
        """SIGUSR2: the call on the rank's main thread raises CallInterrupted."""
        if self.proc is not None and self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, signal.SIGUSR2)

    async def interrupt(self, call_id: str) -> None:
        """Stop one of the calls this rank runs at once (the others go on)."""
        with contextlib.suppress(RankGone, ConnectionError, OSError):
            await self._send(rankchannel.Interrupt(call_id))

    async def _send(self, msg: rankchannel.Message) -> None:
        if not self.alive or self._conn is None:
            raise RankGone(self.death_message())
        try:
            self._conn.write(rankchannel.frame(msg))
            self.ring()
            await self._conn.drain()
        except ConnectionError:
            raise RankGone(self.death_message()) from None

    def _register(self, key: str) -> None:
        """Expect a reply under ``key``: registered before the request leaves, so a fast reply
        cannot arrive unclaimed."""
        self._pending[key] = asyncio.get_running_loop().create_future()

    async def _expect(self, timeout: float | None, what: str, key: str | None = None) -> Any:
        key = key or what
        if self._dead.is_set():
            self._pending.pop(key, None)
            raise RankGone(self.death_message())
        future = self._pending.get(key)
        if not isinstance(future, asyncio.Future):  # (only a call's reply is anything else)
            future = self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            if timeout is None:  # a call: the common case, without wait_for's extra task
                return await asyncio.shield(future)
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise RankGone(f"rank process did not finish {what} within {timeout:.0f}s") from None
        finally:
            self._pending.pop(key, None)

    # ---- I/O callbacks -----------------------------------------------------------------

    def _on_message(self, msg: rankchannel.Message) -> None:
        if type(msg) is rankchannel.Result:  # a call's reply: the one message of every call
            self._heard = self._pipes.drains  # answer() drains unless a drain runs after this
            # taken off: nothing waits under a call id twice (a wait given up on takes its
            # future off itself, see call())
            waiter = self._pending.pop(msg.id, None)
            if msg.streaming:
                self._feeds[msg.id] = feed = Feed(self.global_rank, msg.size)
                if waiter is not None:
                    self._streamed[msg.id] = feed
            if waiter is not None:
                try:  # noqa: SIM105 - suppress() costs three calls more, 64 times a call
                    waiter.set_result(msg)
                except asyncio.InvalidStateError:  # a future given up on (cancelled)
                    pass
            return
        if isinstance(msg, rankchannel.Written):
            self._progress(msg)
            return
        key = (
            "start"
            if isinstance(msg, rankchannel.Ready)
            else "load"
            if isinstance(msg, rankchannel.Loaded)
            else None
        )
        future = self._pending.get(key) if key is not None else None
        if future is not None and not future.done():
            future.set_result(msg)

    def _on_bad(self, e: ProtocolError) -> None:
        """Out of step: nothing it sends can be trusted now."""
        self.stderr_tail.append(f"ktlite: the rank process sent a malformed message: {e}")
        self.kill()

    def _on_lost(self) -> None:
        asyncio.get_running_loop().create_task(self._after_eof())

    async def _after_eof(self) -> None:
        """EOF: the process is exiting; give the pidfd a moment to report the exit code."""
        if self.proc is not None:
            for _ in range(50):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.02)
        self._on_exit()

    def _progress(self, msg: rankchannel.Written) -> None:
        feed = self._feeds.get(msg.id)
        if feed is None:
            return  # a result nobody streams any more
        feed.advance(msg.written, msg.error)
        if feed.finished:
            del self._feeds[msg.id]

    def _on_exit(self) -> None:
        if self._dead.is_set() or self.proc is None:
            return
        code = self.proc.poll()
        if code is None and self._conn is not None and not self._conn.closed:
            return  # pidfd spurious wake-up
        self.exit_code = code
        loop = asyncio.get_running_loop()
        self._output.close(loop)  # what it wrote before it died comes before its death
        self._dead.set()
        resultfiles.remove_left(self.proc.pid)  # the result files it kept, if it was killed
        resultmaps.server().sweep()  # and this server's mappings of them
        for pipe in (self.proc.stdout, self.proc.stderr):  # drained above; don't wait for the GC
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._pidfd is not None:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._conn is not None:
            self._conn.close()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RankGone(self.death_message()))
        if self._feeds:  # results it was still writing are lost with it
            death = self.death_message()
            for feed in self._feeds.values():
                feed.fail(death)
            self._feeds.clear()

    def death_message(self) -> str:
        code = (
            self.exit_code
            if self.exit_code is not None
            else (self.proc.poll() if self.proc else None)
        )
        if self._oom is None:  # asked once per death: the OOM counter is consumed
            self._oom = code == -signal.SIGKILL and oom_killed()
        oom = self._oom
        text = f"rank process {describe_exit(code, oom)}"
        note = getattr(self.proc, "note", "")
        if note:
            text += f": {note}"
        if self.stderr_tail:
            text += "; last stderr lines:\n" + "\n".join("    " + ln for ln in self.stderr_tail)
        return text

    def drain_output(self) -> None:
        """Read whatever the ranks already wrote, so a rank's logs precede its result: one poll
        of every rank's pipes, unless one ran since this rank's last result was read."""
        pipes().drain_after(self._heard)
