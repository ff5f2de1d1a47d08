"""Rank processes forked from a zygote: one warm interpreter per pod server that has imported
everything a rank process imports, and forks each new rank instead of starting a Python.

A rank started as ``python -m ktlite_server.rank`` costs ~90 ms of CPU and ~25 MB before it
runs anything, and each of its calls runs in memory no other rank shares. Forked from one
parent, the ranks of a pod share the interpreter's pages (its modules, code objects and their
caches): measured on 2 cores, a no-op call cost each of 64 ranks 68 us exec'd and 34 us forked
(``bench/README.md``, "Ranks forked from a zygote"), and a rank starts in a few milliseconds.

The zygote (``python -m ktlite_server.rankzygote FD``) is started by the pod server with the
environment every rank process starts with (the pod's own, as before: a deployment's rank
environment arrives later, with its code), or, for a deployment that uses torch, with that
and the modules to preload (``rankpreload``: a restarted rank then finds torch imported,
its pages shared). It imports the rank's modules, freezes its heap
(``gc.freeze``: the children's collections leave those pages unwritten), and serves requests
on a ``SOCK_SEQPACKET`` socketpair, one message each:

    pod server -> zygote:  {"spawn": id, "argv": [...]} + fds (channel, stdout, stderr[, bell])
    zygote -> pod server:  {"spawned": id, "pid": pid} + the child's pidfd
                           {"failed": id, "error": text}
                           {"exited": pid, "code": returncode}   (Popen's: -N for signal N)

A forked child starts its own session (``setsid``), takes the three descriptors as stdin
(``/dev/null``), stdout and stderr, closes the zygote's socket, and returns out of the
zygote's loop into :func:`ktlite_server.rank.main`: the rank ends as a Python program does
(its threads joined, ``atexit`` handlers run). The zygote reaps its children through their
pidfds and reports each exit code; a rank sees its parent go (``rank._watch_parent``), so a
zygote that dies takes its ranks with it, and the pod server names that.

The pod server side (:func:`shared`, :class:`Zygote`, :class:`ForkedProcess`) falls back to
``python -m ktlite_server.rank`` where there is no ``os.fork``/``pidfd_open``, where
``KTLITE_RANK_ZYGOTE=0``, where a rank is to start with another environment than the
:data:`MAX_ZYGOTES` zygotes that still have ranks (one per environment: the pod's, a
preloading one), and for good once a zygote failed to start or :data:`MAX_LOST` were lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import IO, Any

from ktlite_server import rankpreload

logger = logging.getLogger(__name__)

SPAWN_TIMEOUT_S = 30.0  # a fork answers in milliseconds; a zygote this late is replaced
# a zygote's first answer follows its preload: torch's import, seconds (a minute from a cold,
# slow disk)
PRELOAD_TIMEOUT_S = 300.0
MAX_MSG = 1 << 16
MAX_FDS = 8
# this process's zygotes, how many it lost, whether one failed to start, whether pidfds work,
# how many times one was handed out
_state: dict[str, Any] = {"zygotes": [], "lost": 0, "failed": False, "pidfds": None, "uses": 0}


def available() -> bool:
    """Whether ranks may be forked here (Linux with pidfds, not switched off)."""
    if os.environ.get("KTLITE_RANK_ZYGOTE", "1") == "0":
        return False
    if _state["pidfds"] is None:
        _state["pidfds"] = _pidfds()
    return bool(_state["pidfds"])


def _pidfds() -> bool:
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    try:  # a kernel (or a sandbox: gVisor, a seccomp profile) without them says so here
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


# ---- the zygote's side ------------------------------------------------------------------


def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _serve(ctrl: socket.socket, refusal: str | None = None) -> list[str] | None:
    """The zygote's loop: fork on request (or, with a ``refusal``, answer each with it),
    report exits. Returns, in a forked child only, the argv its rank runs with; in the zygote,
    None once the pod server is gone."""
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pidfd -> pid
    ppid = os.getppid()
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is not ctrl:
                pidfd = int(key.fd)
                pid = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                _send(ctrl, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(ctrl, MAX_MSG, MAX_FDS)
            except ConnectionError:
                data, fds = b"", []
            if not data:
                return None  # the pod server is gone: its ranks follow us (their parent)
            req = json.loads(data)
            try:
                pid = _fork(refusal)
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                _send(ctrl, {"failed": req["spawn"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                sel.close()
                for pidfd in children:
                    os.close(pidfd)
                return _become_rank(ctrl, fds, req["argv"])
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            sel.register(pidfd, selectors.EVENT_READ)
            _send(ctrl, {"spawned": req["spawn"], "pid": pid}, [pidfd])
        if os.getppid() != ppid:
            return None  # orphaned without an EOF (the pod server's socket leaked somewhere)


def _fork(refusal: str | None) -> int:
    if refusal is not None:
        raise OSError(refusal)
    with warnings.catch_warnings():
        # Python 3.12+ warns of a fork with threads alive: a preloaded library's (OpenBLAS
        # stops its own around a fork; rankpreload), never a lock-holding one of ours. The
        # pod log is the users': this warning, for the zygote, is not theirs to read
        warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
        return os.fork()


def _become_rank(ctrl: socket.socket, fds: list[int], argv: list[str]) -> list[str]:
    """In a forked child: the rank's own session and standard streams, then its argv (the
    channel's and bell's descriptors named by their numbers here)."""
    ctrl.close()
    os.setsid()
    chan, out, err, *rest = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (devnull, out, err):
        os.close(fd)
    # the rank's argv names its descriptors by their numbers in this process
    names = {"chan": chan, "bell": rest[0] if rest else -1}
    return [str(names.get(a, a)) for a in argv]


def main() -> None:
    from ktlite_server import logconfig, rank  # everything a rank imports, before any fork

    logconfig.configure()  # the pod's level, on the pod log (this process's stderr)
    refusal = rankpreload.preload()  # what this deployment's ranks use (KTLITE_RANK_PRELOAD)
    if refusal is not None:
        logger.error("ktlite: the rank zygote will not fork ranks: %s", refusal)
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    gc.collect()
    gc.freeze()  # the children's collections never write to the zygote's objects' pages
    argv = _serve(ctrl, refusal)
    if argv is None:
        return
    sys.argv = [rank.__file__ or "ktlite_server.rank", *argv]
    rank.main()


# ---- the pod server's side --------------------------------------------------------------


class ForkedProcess:
    """What a rank's :class:`~ktlite_server.ranks.RankProcess` holds instead of a ``Popen``:
    the pid, the read ends of its output pipes, its exit code once the zygote reported it."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.pidfd = pidfd  # the zygote's, passed on: signals reach this process, never a reuse
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.returncode: int | None = None
        self.note = ""  # why it ended, where its exit code cannot say (its zygote died)
        self.on_exit: Callable[[], None] | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def _exited(self, code: int, note: str = "") -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        self.note = note
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self.on_exit is not None:
            self.on_exit()


class Zygote:
    """The pod server's handle on its zygote, on one event loop."""

    def __init__(self, env: dict[str, str], loop: asyncio.AbstractEventLoop) -> None:
        self.env = env
        self.loop = loop
        self.ctrl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ktlite_server.rankzygote", str(child.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=[child.fileno()],
                env=env,
            )
        finally:
            child.close()
        self.ctrl.setblocking(False)
        preloads = rankpreload.names(env.get(rankpreload.PRELOAD_VAR, ""))
        self.timeout = PRELOAD_TIMEOUT_S if preloads else SPAWN_TIMEOUT_S  # see _readable
        self._next = 0
        self._pending: dict[int, asyncio.Future[ForkedProcess]] = {}
        self.children: dict[int, ForkedProcess] = {}
        self.closed = False
        self.used = 0  # when shared() last handed it out (a count): see _retired
        loop.add_reader(self.ctrl.fileno(), self._readable)

    async def spawn(
        self, argv: list[str], chan: int, out: int, err: int, bell: int | None
    ) -> ForkedProcess:
        """Fork a rank (``argv`` may say ``chan``/``bell`` for their descriptors' numbers
        there). Raises OSError when the zygote cannot (the caller starts it the old way)."""
        if self.closed:
            raise OSError("the rank zygote is gone")
        self._next += 1
        key = self._next
        future: asyncio.Future[ForkedProcess] = self.loop.create_future()
        self._pending[key] = future
        fds = [chan, out, err] + ([bell] if bell is not None else [])
        try:
            try:
                request = json.dumps({"spawn": key, "argv": argv}).encode()
                socket.send_fds(self.ctrl, [request], fds)
            except OSError as e:
                self.close(f"a request to it failed: {e}", lost=True)
                raise
            # an OSError from here is its refusal (a fork that failed): its other ranks stay
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except asyncio.TimeoutError:
            self.close(f"it did not fork a rank within {self.timeout:.0f} s", lost=True)
            raise OSError("the rank zygote did not answer") from None
        finally:
            self._pending.pop(key, None)

    def _readable(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.ctrl, MAX_MSG, MAX_FDS)
            except BlockingIOError:
                return
            except OSError as e:
                self.close(f"its socket failed: {e}", lost=True)
                return
            if not data:
                self.close("it exited", lost=True)
                return
            msg = json.loads(data)
            self.timeout = SPAWN_TIMEOUT_S  # it answered: its preload is done
            if "exited" in msg:
                proc = self.children.pop(msg["exited"], None)
                if proc is not None:
                    proc._exited(int(msg["code"]))
                if _retired(self):
                    return
                continue
            future = self._pending.get(msg.get("spawned", msg.get("failed")))
            if "spawned" in msg and fds:
                # known before any later message: its exit may be the next one
                proc = self.children[int(msg["pid"])] = ForkedProcess(int(msg["pid"]), fds[0])
                if future is not None and not future.done():
                    future.set_result(proc)
                else:  # its request gave up waiting: nobody will use it
                    proc.kill()
                continue
            for fd in fds:
                os.close(fd)
            if future is not None and not future.done():
                future.set_exception(OSError(msg.get("error", "the rank zygote refused")))

    def close(self, why: str = "", lost: bool = False) -> None:
        """Stop the zygote; its live ranks are killed (they would follow it anyway) and end
        with SIGKILL's code. ``lost``: it failed (counted against :data:`MAX_LOST`)."""
        if self.closed:
            return
        self.closed = True
        if lost:
            _state["lost"] += 1
            logger.warning("ktlite: the rank zygote (pid %s) was lost: %s", self.proc.pid, why)
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.ctrl.fileno())
        self.ctrl.close()
        for proc in list(self.children.values()):
            proc.kill()
            proc._exited(-signal.SIGKILL, f"the pod's rank zygote, its parent, was lost ({why})")
        self.children.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(OSError(f"the rank zygote is gone: {why}"))
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


MAX_LOST = 3  # zygotes a pod server may lose (one lost now and then is replaced)
MAX_ZYGOTES = 2  # at once: the pod's plain one, and one that preloaded a deployment's modules


def _retired(z: Zygote) -> bool:
    """Stop ``z`` if it has no ranks left and another environment's zygote was asked for
    since it was (a deployment's ranks moved to a preloading one): its memory is not shared
    with any rank any more."""
    newer = any(o.used > z.used and not o.closed for o in _state["zygotes"])
    if z.children or z._pending or not newer:
        return False
    z.close()
    return True


def shared(env: dict[str, str]) -> Zygote | None:
    """This pod server's zygote for ranks that start with ``env`` (started at the first), or
    None: fork is not available, a zygote failed to start, :data:`MAX_LOST` were lost, or
    :data:`MAX_ZYGOTES` for other environments still have ranks. A zygote serves one
    environment: what it preloaded (``rankpreload``) is named in it; one with no ranks left is
    stopped when another environment needs one."""
    if _state["failed"] or _state["lost"] >= MAX_LOST or not available():
        return None
    loop = asyncio.get_running_loop()
    zygotes: list[Zygote] = _state["zygotes"]
    for z in list(zygotes):
        if z.closed or z.loop is not loop or z.loop.is_closed():
            if not z.closed and z.loop is not loop:
                z.close()
            zygotes.remove(z)
    match = next((z for z in zygotes if z.env == env), None)
    for z in [z for z in zygotes if z is not match and not z.children and not z._pending]:
        z.close()  # idle, and another environment is asked for: its preload is not wanted
        zygotes.remove(z)
    _state["uses"] += 1
    if match is not None:
        match.used = _state["uses"]
        return match
    if len(zygotes) >= MAX_ZYGOTES:
        return None
    try:
        z = Zygote(env, loop)
    except OSError as e:
        logger.warning("ktlite: no rank zygote (%s); ranks start as new processes", e)
        _state["failed"] = True
        return None
    zygotes.append(z)
    z.used = _state["uses"]
    return z


def reset() -> None:
    """Drop this process's zygotes and what it remembers of lost ones (tests)."""
    zygotes: list[Zygote] = _state["zygotes"]
    _state.update(zygotes=[], lost=0, failed=False)
    for z in zygotes:
        z.close()


if __name__ == "__main__":
    main()
