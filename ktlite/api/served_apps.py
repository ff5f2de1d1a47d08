"""``kt.app(..., port=P, health_check="/health")``: a command that serves HTTP on its pods.

Where a plain ``kt.app`` runs its command to completion, a served one starts it in the
background of each replica's rank and waits, in the pod, until it answers: ``health_check``
with a 2xx (or, without one, a connection to ``port``). The start fails at once, with the
command's last lines, if the command exits first, and after ``launch_timeout`` naming the last
answer it gave. The command then runs until the deployment is torn down or started again; its
output goes to the pod's log (``ktlite logs NAME``).

The caller reaches it through the pod server (``/ports/P/...``, behind the deployment token:
:mod:`ktlite_server.portproxy`), for which :class:`ktlite.net.portforward.PortForward` puts a
plain local URL in front: ``app.local_port()``, ``app.url``, ``ktlite port-forward NAME P``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from ktlite.errors import ConfigError, ReplicaFailed

POLL_S = 0.2  # how often the pod looks at the port while the command starts
ASK_TIMEOUT_S = 2.0  # one health request's

# this rank's running app (a second start replaces it): the process, its folder, its last lines
_running: dict[str, Any] = {}


def check_port(port: Any, health_check: Any) -> tuple[int | None, str | None]:
    """``kt.app``'s ``port`` and ``health_check``, checked before anything is deployed."""
    if port is None:
        if health_check is not None:
            raise ConfigError(
                f"health_check={health_check!r} needs port=: the port the command serves on"
            )
        return None, None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"port={port!r} must be the port number (1-65535) the command serves on")
    if health_check is not None and (
        not isinstance(health_check, str) or not health_check.startswith("/")
    ):
        raise ConfigError(
            f"health_check={health_check!r} must be a path on the app, such as '/health'"
        )
    return port, health_check


def start_replica(
    command: list[str],
    files: bytes | None,
    cwd: str | None,
    extra_env: dict[str, str],
    port: int,
    health_check: str | None,
    timeout: float,
) -> dict[str, Any]:
    """On a pod: start ``command`` in the background and return once ``port`` answers."""
    from ktlite.net.archive import extract

    stop_replica()  # started again: the old command goes first (it holds the port)
    workdir = None
    if files is not None:
        import tempfile

        workdir = tempfile.mkdtemp(prefix=f"ktlite-app-{os.environ.get('KTLITE_LAUNCH_ID', 'x')}-")
        extract(files, workdir)
    proc = start_command(command, workdir or cwd or os.getcwd(), extra_env)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    reader = threading.Thread(target=_relay, args=(proc, tail), daemon=True, name="ktlite-app-out")
    reader.start()
    _running.update(proc=proc, workdir=workdir)
    deadline = time.monotonic() + timeout
    last = "nothing yet"
    while True:
        code = proc.poll()
        if code is not None:
            reader.join(2.0)
            stop_replica()
            raise ReplicaFailed(
                f"replica {os.environ.get('NODE_RANK', '?')} "
                f"({os.environ.get('KTLITE_POD_NAME', '?')}): `{shlex.join(command)}` exited "
                f"with code {code} before port {port} answered; last lines:\n"
                + "\n".join("    " + ln for ln in tail),
                exit_code=code if code > 0 else 128 - code,
            )
        ok, last = _answers(port, health_check)
        if ok:
            return {"pod": os.environ.get("KTLITE_POD_NAME", ""), "port": port, "pid": proc.pid}
        if time.monotonic() >= deadline:
            stop_replica()
            what = f"GET {health_check} with a 2xx" if health_check else "a connection"
            raise ReplicaFailed(
                f"replica {os.environ.get('NODE_RANK', '?')} "
                f"({os.environ.get('KTLITE_POD_NAME', '?')}): port {port} did not answer "
                f"{what} within launch_timeout={timeout:g}s (last: {last}); the command "
                f"`{shlex.join(command)}` still ran; its last lines:\n"
                + "\n".join("    " + ln for ln in tail),
                exit_code=1,
            )
        time.sleep(POLL_S)


def stop_replica() -> None:
    """Stop this rank's app command, if one runs (SIGTERM to its session, SIGKILL after 5 s)."""
    proc = _running.pop("proc", None)
    if proc is not None:
        stop_command(proc)
    workdir = _running.pop("workdir", None)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def die_with_parent() -> None:
    """In the command's process: get SIGTERM when the replica's rank process dies, so that
    torchrun (which stops its workers on SIGTERM) never outlives a stopped call."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_command(
    command: list[str], cwd: str, extra_env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """A replica's command in a session of its own, its output (both streams) on one pipe,
    SIGTERMed when the rank dies; this pod's ``python`` (and its scripts, torchrun's) first on
    PATH: a caller's venv need not be activated."""
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def stop_command(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the command's session (torchrun stops its workers on it), SIGKILL after 5 s."""
    import signal

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


def _relay(proc: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
    """The command's output, line by line, to this rank's stdout (the pod's log)."""
    assert proc.stdout is not None
    with contextlib.suppress(ValueError, OSError), proc.stdout:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            print(line, flush=True)


def _answers(port: int, health_check: str | None) -> tuple[bool, str]:
    """Whether the app answers, and what it said (for the error when it never does)."""
    if health_check is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=ASK_TIMEOUT_S).close()
        except OSError as e:
            return False, f"connecting to port {port}: {e.strerror or e}"
        return True, "accepted a connection"
    url = f"http://127.0.0.1:{port}{health_check}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
    try:
        with opener.open(url, timeout=ASK_TIMEOUT_S) as answer:
            return 200 <= answer.status < 300, f"GET {health_check} answered {answer.status}"
    except urllib.error.HTTPError as e:
        return False, f"GET {health_check} answered {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return False, f"GET {health_check}: {reason}"
