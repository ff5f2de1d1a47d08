"""A peer system (Ray, Monarch) kept running in a process of its own, asked for one round at a time.

The benches interleave ktlite and its peers round by round (``_rounds.py``), so a peer's
runtime must outlive one measurement: the peer process starts its runtime once, answers
``ready``, then runs one request per line of its stdin. Replies travel on a pipe of their own
(``--reply-fd``), not on stdout, which the runtimes and their children write to at will.

Both sides are here; standard library only (the peer may run in another venv):

- bench side: ``PeerProcess(name, cmd, start_timeout, env=None, cwd=None)``; ``.ready`` is the
  peer's first reply;
  ``.ask(op, timeout, **kwargs)`` returns the handler's result; ``.close()`` stops it all.
- peer side: ``replies = open_replies(fd)`` first thing (before the runtime starts, so its
  children do not inherit the pipe), then ``replies.serve(ready, handlers)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

# ---- peer side --------------------------------------------------------------------------------


class Replies:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def serve(self, ready: dict[str, Any], handlers: dict[str, Callable[..., Any]]) -> None:
        """Reply ``ready``, then answer each request line ``{"op": name, **kwargs}`` until
        ``{"op": "stop"}`` or the end of stdin."""
        self.send({"result": ready})
        for line in sys.stdin:
            request = json.loads(line)
            op = request.pop("op")
            if op == "stop":
                break
            try:
                self.send({"result": handlers[op](**request)})
            except Exception:  # noqa: BLE001 - the bench side raises it, with this traceback
                self.send({"error": traceback.format_exc(limit=8)})


def open_replies(fd: int) -> Replies:
    os.set_inheritable(fd, False)  # the runtime's own processes must not hold the pipe open
    return Replies(os.fdopen(fd, "w"))


# ---- bench side -------------------------------------------------------------------------------


class PeerProcess:
    """``cmd`` (a peer script taking ``--reply-fd``) in its own session, up until ``close()``."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        start_timeout: float,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.name = name
        # the peer's stdout and stderr, for its errors; lives as long as the peer (close())
        self.output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*cmd, "--reply-fd", str(write)],
                stdin=subprocess.PIPE,
                stdout=self.output,
                stderr=subprocess.STDOUT,
                text=True,
                pass_fds=(write,),
                start_new_session=True,
                env=env,
                cwd=cwd,
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._read = read
        self._buffer = b""
        try:
            self.ready: Any = self._reply(start_timeout, "its start (ready)")
        except BaseException:
            self.close()
            raise

    def ask(self, op: str, timeout: float, **kwargs: Any) -> Any:
        """Run ``op`` in the peer; its result, or RuntimeError/TimeoutError naming what failed."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(
                f"{self.name} peer exited (code {self.proc.poll()}) before it was asked "
                f"{op}; its output ended with: {self.tail()}"
            ) from None
        return self._reply(timeout, f"its answer to {op}({kwargs})")

    def _reply(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name} peer: waited {timeout:g} s for {what}, nothing came; the "
                    f"bench stops it. Its output ended with: {self.tail()}"
                )
            readable, _, _ = select.select([self._read], [], [], min(left, 1.0))
            if readable:
                chunk = os.read(self._read, 1 << 16)
                if not chunk:
                    code = self.proc.wait(10)
                    raise RuntimeError(
                        f"{self.name} peer exited with code {code} while the bench awaited "
                        f"{what}; its output ended with: {self.tail()}"
                    )
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.name} peer failed at {what}:\n{message['error']}")
        return message["result"]

    def tail(self, lines: int = 5) -> str:
        self.output.seek(0)
        return " | ".join(self.output.read().strip().splitlines()[-lines:]) or "(nothing)"

    def close(self) -> None:
        """Ask the peer to stop (its runtime's own shutdown), then end its whole session."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever its runtime left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.close(self._read)
        self.output.close()
