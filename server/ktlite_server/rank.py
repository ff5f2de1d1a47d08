"""A rank process: loads the user's code once, then runs calls sent by its pod server.

Started as ``python -m ktlite_server.rank FD [BELL_FD BIT]`` with FD one end of a socketpair
(and the pod server's doorbell, ``ktlite_server.doorbell``, waited on instead of FD). Messages
both ways are ``ktlite_wire.rankchannel`` messages (a JSON header plus buffers); user code
and values inside them are opaque bytes (inline, or a shared-memory file when large) that
this process alone unpickles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.abc
import importlib.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import types
from typing import Any

from ktlite_server import (
    argmaps,
    doorbell,
    logconfig,
    rankreply,
    resultfeed,
    resultfiles,
    workdir,
)
from ktlite_server.distpatch import PatchOnImport, holds_dist_state
from ktlite_server.rankrunners import Runners
from ktlite_wire import codec, rankchannel, rankdata, shm, sourcelines
from ktlite_wire.distenv import GROUP_PORTS
from ktlite_wire.errors import RemoteExceptionInfo
from ktlite_wire.rankend import Channel


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the caller's local (not installed) modules from shipped source text."""

    def __init__(self, sources: dict[str, tuple[str, str, bool]]) -> None:
        self.sources = sources

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        entry = self.sources.get(fullname)
        if entry is None:
            return None
        filename, _, is_pkg = entry
        return importlib.util.spec_from_loader(fullname, self, origin=filename, is_package=is_pkg)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        filename, source, _ = self.sources[module.__name__]
        module.__file__ = filename
        # the caller's file is rarely here, and may differ: tracebacks show the text that ran
        sourcelines.register_text(filename, source)
        exec(compile(source, filename, "exec"), module.__dict__)


def _task_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task or a Monarch endpoint raised, out of the wrapper the engine
    hands the caller (``RayTaskError``: a class Ray makes at run time, which the caller could
    not rebuild from a pickle; Monarch's ``ActorError``). The traceback text keeps where it
    was raised."""
    wrappers = []
    rex = sys.modules.get("ray.exceptions")
    if rex is not None and getattr(rex, "RayTaskError", None) is not None:
        wrappers.append((rex.RayTaskError, "cause"))
    mex = sys.modules.get("monarch._src.actor.actor_mesh")
    if mex is not None and getattr(mex, "ActorError", None) is not None:
        wrappers.append((mex.ActorError, "exception"))
    for _ in range(8):  # a task that got a failed task's error wraps it again
        cause = next(
            (getattr(exc, attr, None) for cls, attr in wrappers if isinstance(exc, cls)), None
        )
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def exception_info(exc: BaseException, where: str = "") -> RemoteExceptionInfo:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    exc = _task_cause(exc)  # the traceback above keeps the engine's text of where it raised
    pickled: bytes | None
    try:
        pickled = codec.dumps(exc)
        codec.loads(pickled)  # a type whose __reduce__ cannot rebuild it is sent as text
    except Exception:
        pickled = None
    t = type(exc)
    return RemoteExceptionInfo(
        type_name=f"{t.__module__}.{t.__qualname__}",
        message=(where + str(exc)) if where else str(exc),
        traceback=tb,
        pickled=pickled,
    )


class CallInterrupted(BaseException):
    """Raised inside a call the caller cancelled or timed out while it shared its rank
    process with other calls (``Compute(concurrency=K)``): only that call stops."""


class Rank:
    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.kind = "fn"
        self.target: Any = None
        self.finder: _SourceFinder | None = None
        # colocated targets (``kt.cls(B).to(remote_a)``): name -> function or instance, in
        # this same process beside the primary ``self.target``
        self.targets: dict[str, Any] = {}
        self.target_sources: dict[str, dict[str, tuple[str, str, bool]]] = {}
        self.concurrency = 1
        self.runners: Runners | None = None  # the threads running calls (concurrency > 1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self.inline: str | None = None  # the call running on the main thread (concurrency 1)
        self.generation = 0  # of the deployment's process group: see regroup()
        self.base_port: int | None = None
        self.tasks: dict[
            str, concurrent.futures.Future[Any]
        ] = {}  # call id -> its coroutine's future
        self.tainted = False  # interrupted inside an import: see _result()

    def submit(self, msg: rankchannel.Call) -> None:
        """Run a call: inline (one at a time) or on up to ``concurrency`` threads."""
        if self.concurrency <= 1:
            try:
                self.call(msg)
            except CallInterrupted as exc:  # between the user's code and the reply
                self.inline = None
                self._result(msg.id, False, exception_info(exc), exc)
            return
        if self.runners is None:
            self.runners = Runners(self.call, self.concurrency, CallInterrupted)
        self.runners.submit(msg)

    def patience(self) -> float | None:
        """How long the channel may be waited on before a queued call needs a thread."""
        return self.runners.patience() if self.runners is not None else None

    def interrupt(self, call_id: str) -> None:
        """Stop one call and leave the others running: its coroutine is cancelled, its thread
        gets CallInterrupted at its next Python instruction, or (not started yet) it is
        answered as interrupted. The pod server kills the process if the call has not ended
        after a grace period."""
        task = self.tasks.get(call_id)
        if task is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(task.cancel)
            return
        queued = self.runners.interrupt(call_id) if self.runners is not None else None
        if queued is not None:
            exc = CallInterrupted("the call was stopped before it started")
            self._result(call_id, False, exception_info(exc), exc)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The rank's own event loop (one thread, started at the first ``async def`` call):
        every coroutine of every call runs on it, so they can share loop-bound objects."""
        with self._loop_lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="ktlite-loop", daemon=True).start()
                self.loop = loop
            return self.loop

    def _await(self, call_id: str, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._event_loop())
        self.tasks[call_id] = future
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise CallInterrupted("the call was cancelled") from None
        except CallInterrupted:
            future.cancel()  # interrupted while waiting: the coroutine stops too
            raise
        finally:
            self.tasks.pop(call_id, None)

    def regroup(self, generation: int, port: int | None = None) -> None:
        """Pod 0 moves the deployment to a new process-group generation after a failed call
        or a rank restart: the next ``init_process_group`` in a call leaves the old group and
        rendezvouses on ``port`` (pod 0's pick, free there; without one MASTER_PORT +
        generation mod PORT_SPAN), away from the old store."""
        if generation == self.generation:
            return
        self.generation = generation
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)
        elif self.base_port is not None:
            os.environ["MASTER_PORT"] = str(self.base_port + generation % PORT_SPAN)
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            vars(dist)["_ktlite_stale"] = True  # a marker of ktlite's own on the module

    def load(self, msg: rankchannel.Load) -> None:
        if msg.target:
            self.load_target(msg)
            return
        os.environ.update(msg.env)
        port = msg.env.get("MASTER_PORT")
        self.base_port = int(port) if port and port.isdigit() else None
        self.generation = 0
        self.target = None
        concurrency = max(1, msg.concurrency)
        if concurrency != self.concurrency and self.runners is not None:
            self.runners.close()
            self.runners = None
        self.concurrency = concurrency
        sources = msg.sources
        if self.finder is not None:
            sys.meta_path.remove(self.finder)
            for name in self.finder.sources:  # edited local modules must be re-imported
                sys.modules.pop(name, None)
            self.finder = None
        kept = {m: src for srcs in self.target_sources.values() for m, src in srcs.items()}
        if sources or kept:  # colocated targets that stay keep their modules importable
            self.finder = _SourceFinder({**kept, **sources})
            sys.meta_path.append(self.finder)
        try:
            obj = pickle.loads(msg.bundle or b"")
            self.kind = msg.kind
            if self.kind == "cls":
                args, kwargs = codec.loads(msg.init) if msg.init is not None else ((), {})
                obj = obj(*args, **kwargs)
            self.target = obj
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            rankreply.flush()
            self._loaded(exception_info(exc))
            return
        rankreply.flush()
        self._loaded(None)

    def load_target(self, msg: rankchannel.Load) -> None:
        """Add, replace (or with ``drop``, remove) a colocated target; the primary and the
        other colocated targets are left as they are."""
        name = msg.target
        self.targets.pop(name, None)
        self.target_sources.pop(name, None)
        if msg.drop:
            self._loaded(None)
            return
        sources = msg.sources
        if sources:
            self.target_sources[name] = sources
            if self.finder is None:
                self.finder = _SourceFinder(dict(sources))
                sys.meta_path.append(self.finder)
            else:  # the primary's modules win: they are already imported under these names
                for mod, src in sources.items():
                    self.finder.sources.setdefault(mod, src)
        try:
            obj = pickle.loads(msg.bundle or b"")
            if msg.kind == "cls":
                args, kwargs = codec.loads(msg.init) if msg.init is not None else ((), {})
                obj = obj(*args, **kwargs)
            self.targets[name] = obj
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            rankreply.flush()
            self._loaded(exception_info(exc, where=f"colocated target {name!r}: "))
            return
        rankreply.flush()
        self._loaded(None)

    def lookup(self, method: Any) -> Any:
        """The callable for a call's ``method``: a name on the primary target, or a
        ``(target, name)`` pair for a colocated target (name None: the target itself)."""
        if isinstance(method, tuple):
            name, method = method
            if name not in self.targets:
                raise RuntimeError(
                    f"colocated target {name!r} is not loaded on this rank (torn down, "
                    "or its colocation failed); colocate it again with .to(remote)"
                )
            target = self.targets[name]
        else:
            if self.target is None:
                raise RuntimeError("no code is loaded on this rank; redeploy with .to()")
            target = self.target
        return target if method is None else getattr(target, method)

    def call(self, msg: rankchannel.Call) -> None:
        call_id = msg.id
        if msg.generation != self.generation:
            self.regroup(msg.generation, msg.group_port)
        # arrays decoded from the arguments must be writable: a private copy-on-write mapping
        # of the file, or the channel's message (a buffer of this call's own)
        mapped = None
        if msg.args is None:  # the shared message and this rank's items, in one mapping
            end = msg.size if msg.item_at is None else max(msg.size, sum(msg.item_at))
            mapped = argmaps.open_map(msg.path or "", end)
        ok, value, error = self._invoke(msg, mapped)
        # the arguments' views are gone with _invoke's frame, unless the function kept some
        # (or returned one, or raised: its traceback holds them): then the file stays unused
        released = mapped is not None and argmaps.let_go(mapped)
        self._result(call_id, ok, value, error, released)

    def _invoke(
        self, msg: rankchannel.Call, mapped: argmaps.ArgMap | None
    ) -> tuple[bool, Any, BaseException | None]:
        """Decode a call's arguments (from ``mapped``, or inline) and run it: (ok, value or
        exception info, the exception)."""
        try:
            if mapped is not None:
                payload: Any = mapped.view[: msg.size]
            else:  # the channel's message is this call's own buffer: writable views of it
                payload = msg.args
                if type(payload) is not memoryview or payload.readonly:
                    payload = bytearray(payload or b"")
            method, args, kwargs = codec.loads(payload)
            del payload
            if msg.item is not None:  # a per-rank call: this rank's own items
                args, kwargs = rankdata.fill(args, kwargs, codec.loads(bytearray(msg.item)))
            elif msg.item_at is not None and mapped is not None:  # ... in the call's file
                off, n = msg.item_at
                args, kwargs = rankdata.fill(args, kwargs, codec.loads(mapped.view[off : off + n]))
            target = self.target
            fn = target if method is None and target is not None else self.lookup(method)
            if self.concurrency <= 1:
                self.inline = msg.id  # SIGUSR2 interrupts it from here ...
            value = fn(*args, **kwargs)
            del args, kwargs
            # an ``async def``: awaited on the rank's event loop
            if isinstance(value, types.CoroutineType):
                value = self._await(msg.id, value)
            self.inline = None  # ... to here
            return True, value, None
        except BaseException as exc:  # noqa: BLE001
            self.inline = None
            return False, exception_info(exc), exc

    def _result(
        self,
        call_id: str,
        ok: bool,
        value: Any,
        error: BaseException | None = None,
        released: bool = False,
    ) -> None:
        """Reply with a call's value (or its exception's info). An interrupt that landed
        inside an import leaves this process unable to import that module again (a C
        extension such as torch's registers its types once: "an object with that name is
        already defined"), so the reply asks the pod to replace the process."""
        if isinstance(error, CallInterrupted) and any(
            frame.f_code.co_filename.startswith("<frozen importlib")
            for frame, _ in traceback.walk_tb(error.__traceback__)
        ):
            self.tainted = True
        if rankreply.is_plain(value):  # what most calls return: one message, built at once
            inline = rankreply.NONE_VALUE if value is None else rankreply.plain_value(value)
            rankreply.flush()
            self.chan.send_frame(
                rankchannel.result_frame(
                    call_id, ok, inline, holds_dist_state(), self.tainted, released
                )
            )
            return
        try:
            parts = rankreply.encoded(value)
        except Exception as exc:
            ok, parts = (
                False,
                codec.dumps_parts(
                    exception_info(
                        exc, where=f"the return value ({type(value).__name__}) cannot be pickled: "
                    )
                ),
            )
        rankreply.flush()
        size = codec.parts_size(parts)
        if size <= shm.INLINE_MAX:
            self.chan.send(
                rankchannel.Result(
                    call_id,
                    ok,
                    b"".join(parts),
                    None,
                    size,
                    holds_dist_state(),
                    self.tainted,
                    released=released,
                )
            )
            return
        # large: the pod server sends each piece while this process writes the next
        fd, path = resultfiles.process().create(size)  # a warm file where one is free
        try:
            self.chan.send(
                rankchannel.Result(
                    call_id,
                    ok,
                    None,
                    path,
                    size,
                    holds_dist_state(),
                    self.tainted,
                    True,
                    released,
                )
            )
            written = 0

            def progress(n: int) -> None:
                nonlocal written
                written = n
                self.chan.send(rankchannel.Written(call_id, n))

            try:
                shm.write_into(fd, parts, resultfeed.PIECE, progress)
            except OSError as e:  # a full /dev/shm: the server cuts the stream, naming this
                self.chan.send(
                    rankchannel.Written(
                        call_id, written, f"writing it to {path} failed: {e.strerror or e}"
                    )
                )
        finally:
            os.close(fd)

    def _loaded(self, error: RemoteExceptionInfo | None) -> None:
        """Answer a load; a failure's info goes pickled, for the caller alone to read."""
        self.chan.send(
            rankchannel.Loaded(error is None, None if error is None else codec.dumps(error))
        )


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            resultfiles.process().clear()
            os._exit(1)  # the pod server is gone: never outlive it


PORT_SPAN = GROUP_PORTS  # process-group generations cycle through MASTER_PORT .. + 31


def main() -> None:
    rankreply.note_streams()
    logconfig.configure()  # the pod's level; records go to this rank's stderr, the pod log
    # argv: the channel's fd, and (where the pod server has one) its doorbell's and our bit
    bell = doorbell.attach(int(sys.argv[2])) if len(sys.argv) > 3 else None
    bit = int(sys.argv[3]) if bell is not None else 1
    chan = Channel(socket.socket(fileno=int(sys.argv[1])), bell, bit)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    sys.meta_path.insert(0, PatchOnImport())
    workdir.enter()  # started where no user file can shadow ktlite; user code runs here
    rank = Rank(chan)

    def interrupted(signum: int, frame: Any) -> None:
        # SIGUSR2 from the pod server: stop the call running on the main thread (a sibling
        # rank failed, or the caller cancelled), keeping the process and its state
        if rank.inline is not None:
            raise CallInterrupted("the call was stopped")

    signal.signal(signal.SIGUSR2, interrupted)
    chan.send(rankchannel.Ready(os.getpid()))
    while True:
        try:
            msg = chan.recv() if rank.runners is None else chan.recv(rank.patience())
        except EOFError:
            return
        if msg is None:  # a queued call waited long enough: patience() gave it a thread
            continue
        if type(msg) is rankchannel.Call:  # the one message of every call, first
            rank.submit(msg)
        elif isinstance(msg, rankchannel.Load):
            rank.load(msg)
        elif isinstance(msg, rankchannel.Interrupt):
            rank.interrupt(msg.id)
        elif isinstance(msg, rankchannel.Exit):
            return


if __name__ == "__main__":
    main()
