"""An engine a pod server runs beside its ranks: one long-lived process tree per pod (a Ray
node for ``distribute("ray")``, a Monarch worker loop for ``distribute("monarch")``).

The tree runs in a session of its own that dies with the pod server (``PR_SET_PDEATHSIG``).
Stopping it is SIGTERM to the engine's own process (its orderly shutdown), then SIGKILL to
every process left in its session: engines spawn children in process groups of their own
(Monarch's procs), which a group kill would miss. Nothing outside the session is touched
(``ray stop`` would kill every Ray on the machine, the user's own included).

Subclasses (``ktlite_server.raynode``, ``ktlite_server.monarchhost``) say how to start the
process and when it is ready; the pod server drives them through :class:`Engine`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ktlite_server.peers import PeerPool

STOP_GRACE_S = 5.0

Log = Callable[[str], None]


class EngineError(Exception):
    """The engine could not be started on this pod; the message says why and what to do."""


def die_with_parent() -> None:
    """In the child before exec: a session of its own, SIGTERM when the pod server dies."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Linux ``/proc``); empty where it cannot be read."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != sid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X", "x"):
            pids.append(pid)
    return pids


def env_without_token() -> dict[str, str]:
    """The pod server's environment minus its deployment token: an engine's processes run
    user code and must not hold it."""
    return {k: v for k, v in os.environ.items() if k != "KTLITE_TOKEN"}


async def wait_port(
    host: str,
    port: int,
    deadline: float,
    what: str,
    hint: str,
    gave_up: Callable[[], Awaitable[str | None]] | None = None,
) -> None:
    """Until ``host:port`` accepts a connection; ``gave_up()`` (every 0.5 s) says why it
    never will (the head failed), or None. ``hint`` ends the timeout's message: where to look."""
    last = ""
    asked = 0.0
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
            writer.close()
            return
        except (OSError, asyncio.TimeoutError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise EngineError(f"{what} did not accept connections in time (last: {last}); {hint}")
        if gave_up is not None and time.monotonic() - asked >= 0.5:
            asked = time.monotonic()
            why = await gave_up()
            if why:
                raise EngineError(
                    f"{what} will not answer: the head could not start its engine "
                    f"({why.splitlines()[0]})"
                )
        await asyncio.sleep(0.05)


class Engine:
    """One engine process tree on this pod. ``cfg`` comes from the client
    (``ktlite.modes.engines``); a deploy with the same ``cfg`` keeps the running engine."""

    kind = ""

    def __init__(
        self,
        cfg: dict[str, Any],
        pod: str,
        log: Log,
        launch_id: str = "",
        peers: PeerPool | None = None,
    ) -> None:
        self.cfg = cfg
        self.pod = pod
        self.peers = (
            peers or PeerPool()
        )  # asks the other pods' servers (with the deployment's token)
        self.log = log
        self.launch_id = launch_id
        self.proc: asyncio.subprocess.Process | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=60)
        self.started_at: float | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lines: list[tuple[str, asyncio.Event]] = []  # (text awaited, set when seen)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def tail(self, lines: int = 25) -> str:
        return "\n".join(list(self.output)[-lines:]) or "(no output)"

    # ---- what a subclass says ----------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Start the engine and return once it serves, within ``timeout`` seconds."""
        raise NotImplementedError

    @classmethod
    def rank_env(cls, cfg: dict[str, Any]) -> dict[str, str]:
        """What the rank processes of a pod with these engine settings need to reach it."""
        return {}

    async def await_cluster(self, timeout: float) -> None:
        """On pod 0: until every pod's engine has joined (raise EngineError naming the
        missing ones). Others: nothing."""

    async def cluster_status(self) -> dict[str, Any]:
        """``status()`` plus, on pod 0, the members seen and the lost ones named."""
        return self.status()

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "head": bool(self.cfg.get("head")),
            "pid": self.proc.pid if self.proc else None,
            "alive": self.alive,
            "started_at": self.started_at,
        }

    def _cleanup(self) -> None:
        """After the process tree is gone: remove what it left on disk."""

    # ---- the process ---------------------------------------------------------------------

    async def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def _expect(self, text: str) -> asyncio.Event:
        """An event set when the engine prints a line containing ``text``."""
        seen = asyncio.Event()
        self._lines.append((text, seen))
        return seen

    async def _until(
        self, ready: Awaitable[Any], timeout: float, failed: Awaitable[Any] | None = None
    ) -> bool:
        """Wait for ``ready`` until ``timeout``, the process's end or ``failed`` (a sign that
        it will never come); whether it came."""
        waiter = asyncio.ensure_future(ready)
        assert self._reader is not None
        also = [asyncio.ensure_future(failed)] if failed is not None else []
        try:
            await asyncio.wait(
                [waiter, self._reader, *also],
                timeout=max(0.0, timeout),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for task in (waiter, *also):
                if not task.done():
                    task.cancel()
        return waiter.done() and not waiter.cancelled() and waiter.exception() is None

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            text = line.decode(errors="replace").rstrip()
            self.output.append(text)
            self.log(text)
            for want, seen in self._lines:
                if want in text:
                    seen.set()
        await self.proc.wait()

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the engine, then SIGKILL to whatever of its session is left; then
        :meth:`_cleanup`."""
        proc = self.proc
        if proc is not None:
            sid = proc.pid  # setsid: the session is the process's own id
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(sid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            deadline = time.monotonic() + 5
            while (left := session_pids(sid)) and time.monotonic() < deadline:
                for pid in left:  # children that moved to process groups of their own
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(0.05)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
            if self._reader is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._reader, 2)
        self._cleanup()
        self.proc = None
