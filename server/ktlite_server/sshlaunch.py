"""``python -m ktlite_server.sshlaunch``: start a pod server on a host of the ssh backend.

Run by the client over an SSH channel, with only the standard library and ktlite's source on
``PYTHONPATH``. Its first stdin line is JSON: the deployment token (and, with TLS, the
deployment's certificate and key, handed on to the server's stdin too), the server's arguments
and environment (secrets stay off argv, which ``ps`` shows), file secrets (written under the
run directory's ``secrets/``, 0600), the image's setup steps, the run directory. It runs the
setup steps, makes sure the server's packages import (never asking a package index for them
unless a setup step does: where they are missing it says how to get them), starts the server in a session of its own with its output in
the run directory's log, hands it the token, waits until it serves and prints one JSON line
(``{"port", "pid", "python"}`` or ``{"error"}``).

Detached, it exits then. Otherwise it stays as the channel's process: when the channel
closes (the client's process or its SSH connection is gone) it closes the server's stdin,
and the server (``--tether-stdin``) stops.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ktlite_server.packages import missing_in
from ktlite_wire import privatefiles

PORT_RANGE = (20000, 32000)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _fail(message: str) -> None:
    _reply({"error": message})
    sys.exit(1)


def check_packages(python: str, pins: dict[str, str], *, after_steps: bool) -> None:
    """Fail, saying how to fix it, when ``python`` lacks a server package (``pins``: at the
    client's version: cloudpickle's format changes between versions). Nothing is fetched from
    a package index here: the client ships its own packages to a host whose Python has its
    minor version and machine; any other host installs them itself, or asks ktlite to with
    ``kt.Image().pip_install``."""
    missing = missing_in(python, pins)
    if not missing:
        return
    wanted = [
        f"{p}=={pins[p]}" if p in pins else "uvicorn[standard]" if p == "uvicorn" else p
        for p in missing
    ]
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    if after_steps:
        how = "the image's setup steps did not install them"
    else:
        how = (
            "the client ships its own copies only to a host whose Python has its minor version "
            "and machine, and ktlite asks no package index unless told to"
        )
    _fail(
        f"the pod server needs {', '.join(wanted)}, which {python} (Python {minor}) lacks; "
        f"{how}. Install them there ({python} -m pip install {' '.join(wanted)}), pass "
        "kt.Hosts(..., python=...) naming a Python with the client's minor version, or let "
        f"ktlite install them from this host's package index: kt.Image().pip_install({wanted!r})"
    )


def setup(steps: list[Any], cache: Path, log: Any, log_path: Path) -> str:
    """The image's setup steps (``kt.Image.pip_install`` / ``run_bash``), as a Kubernetes pod
    runs them (``ktlite_server.boot``), cached per user; their output goes to the log."""
    from ktlite_server.boot import SETUP_FAILED_EXIT, run_steps

    sys.stdout.flush()
    reply_fd = os.dup(1)
    os.dup2(log.fileno(), 1)  # the steps print to stdout: into the log, not into our reply
    try:
        return run_steps(steps, cache / "setup")
    except SystemExit as e:
        if e.code != SETUP_FAILED_EXIT:
            raise
    finally:
        sys.stdout.flush()
        os.dup2(reply_fd, 1)
        os.close(reply_fd)
    _fail(f"an image setup step failed; its output is in {log_path}")
    raise AssertionError  # _fail exits


def pick_ports(span: int, host: str) -> int:
    """A MASTER_PORT with ``span`` free ports after it on this host."""

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
        return True

    low, high = PORT_RANGE[0], PORT_RANGE[1] - span
    start = random.SystemRandom().randrange(low, high)
    for port in itertools.chain(range(start, high), range(low, start)):
        if all(free(p) for p in range(port, port + span)):
            return port
    _fail(
        f"no {span} free ports in a row between {PORT_RANGE[0]} and {PORT_RANGE[1]} on this host; "
        "pass distribute(port=...)"
    )
    raise AssertionError


def bindable(address: str) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def write_secret_files(files: list[dict[str, Any]], run: Path) -> dict[str, str]:
    """The deployment's file secrets, under ``run/secrets`` as under a home (dirs 0700, files
    0600, never readable by others); the env vars that name them."""
    import base64

    pointers: dict[str, str] = {}
    home = run / "secrets"
    for item in files:
        target = home / item["path"]
        if ".." in Path(item["path"]).parts or Path(item["path"]).is_absolute():
            _fail(f"secret file path {item['path']!r} leaves the run directory")
        privatefiles.make_dir(target.parent)
        privatefiles.write_file(target, base64.b64decode(item["data"]))
        if item.get("pointer"):
            pointers[item["pointer"]] = str(target)
    return pointers


def main() -> None:
    msg = json.loads(sys.stdin.readline())
    run = Path(msg["run_dir"]).expanduser()
    cache = Path(msg["cache_dir"]).expanduser()
    # the cache (ktlite's source, packages, setup) and the run directory (its log may hold
    # what the user's code prints): this user's alone, tightened where an older ktlite made them
    privatefiles.make_dir(cache)
    privatefiles.make_dir(run)
    log_path = run / "pod.log"
    ready = run / "ready.json"
    ready.unlink(missing_ok=True)
    with (
        privatefiles.open_append(log_path) as log,
        privatefiles.open_append(cache / ".lock") as lock,
    ):
        # hosts may share a home directory (NFS; or several pods on one machine): one
        # venv build or setup at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        steps = msg.get("steps")
        python = setup(steps, cache, log, log_path) if steps else sys.executable
        check_packages(python, msg.get("pins", {}), after_steps=bool(steps))
    bind = msg["bind"] if bindable(msg["bind"]) else "0.0.0.0"
    reply: dict[str, Any] = {"python": python, "bind": bind}
    if msg.get("pick_master_port"):
        reply["master_port"] = pick_ports(int(msg["pick_master_port"]), bind)
    argv = [
        python,
        "-m",
        "ktlite_server",
        "--host",
        bind,
        "--port",
        "0",
        "--token-stdin",
        "--ready-file",
        str(ready),
        *msg["args"],
    ]
    if not msg["detached"]:
        argv.append("--tether-stdin")
    if msg.get("tls"):  # the certificate and key follow the token on the server's stdin
        argv.append("--tls-stdin")
    env = {**os.environ, **msg["env"], **write_secret_files(msg.get("secret_files") or [], run)}
    with privatefiles.open_append(log_path) as log:
        server = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run,
            start_new_session=True,
        )
    assert server.stdin is not None
    server.stdin.write(msg["token"].encode() + b"\n")
    if msg.get("tls"):
        server.stdin.write(json.dumps(msg["tls"]).encode() + b"\n")
    server.stdin.flush()
    if msg["detached"]:
        server.stdin.close()
    deadline = time.monotonic() + float(msg.get("timeout", 300))
    while not ready.exists():
        if server.poll() is not None:
            tail = log_path.read_bytes()[-3000:].decode(errors="replace")
            _fail(
                f"the pod server exited with code {server.returncode}; the end of {log_path}:\n{tail}"
            )
        if time.monotonic() > deadline:
            server.kill()
            _fail(f"the pod server did not serve within {msg.get('timeout', 300)}s; see {log_path}")
        time.sleep(0.02)
    reply.update(json.loads(ready.read_text()))
    _reply(reply)
    if msg["detached"]:
        return
    # tethered: the server lives as long as this channel
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        server.stdin.close()


if __name__ == "__main__":
    main()
