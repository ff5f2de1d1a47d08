"""Functions the real-cluster tests run on pods.

A top-level local module: ktlite pickles it by value and ships its source, so the pods
need neither the tests directory nor anything beyond the standard library (``torch`` only
for :func:`gloo_all_reduce`, which runs on the torch image).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "POD_IPS",
    "KTLITE_POD_NAME",
    "FOO",
)


def _env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ENV_KEYS}


def whoami(x: int, caller_file: str | None = None) -> dict[str, object]:
    """``caller_file``: a path of the caller's, which a pod must not see."""
    return {
        "value": x * 2,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": list(sys.version_info[:2]),
        "env": _env(),
        "sees_caller_file": caller_file is not None and os.path.exists(caller_file),
    }


def gloo_all_reduce() -> dict[str, object]:
    """torch.distributed as a user writes it: init with no arguments, then a collective."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": float(t.item()),
        "hostname": socket.gethostname(),
        "env": _env(),
    }


def job(mode: str, arg: str | float | None = None) -> object:
    """Modes: ``rank`` returns the rank; ``fail1`` rank 1 raises ValueError after ``arg``
    seconds (the others return at once); ``print`` prints ``arg`` to stdout and stderr."""
    rank = int(os.environ["RANK"])
    if mode == "rank":
        return rank
    if mode == "fail1":
        if rank == 1:
            time.sleep(float(arg or 0))
            print("rank 1 is about to fail", flush=True)
            raise ValueError(f"boom from rank 1 on {socket.gethostname()}")
        return {"rank": rank, "hostname": socket.gethostname()}
    if mode == "print":
        print(f"{arg} out rank={rank}", flush=True)
        print(f"{arg} err rank={rank}", file=sys.stderr, flush=True)
        return rank
    raise AssertionError(f"unknown mode {mode!r}")


def version_one() -> dict[str, object]:
    return {
        "version": 1,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "foo": os.environ.get("FOO"),
    }


def version_two() -> dict[str, object]:
    return {
        "version": 2,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "foo": os.environ.get("FOO"),
    }


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if len(line.split()) > 4]


def volume_io(op: str, path: str, data: str | None = None) -> dict[str, object]:
    """``write`` ``data`` to ``path`` or ``read`` it; says whether its directory is a mount
    point of this container (from /proc/self/mountinfo: right for bind mounts too)."""
    mount = os.path.dirname(path)
    out: dict[str, object] = {"mounted": mount in _mount_points(), "hostname": socket.gethostname()}
    if op == "write":
        with open(path, "w") as f:
            f.write(data or "")
            f.flush()
            os.fsync(f.fileno())
    elif op == "read":
        out["data"] = None
        if os.path.exists(path):
            with open(path) as f:
                out["data"] = f.read()
    else:
        raise AssertionError(f"unknown op {op!r}")
    return out


class GroupWorker:
    """Worker-group checks: per-rank state, a collective, a rank that dies on request."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, item: object = None, die_on: int | None = None) -> dict[str, object]:
        rank = int(os.environ["RANK"])
        if rank == die_on:
            time.sleep(0.2)
            os._exit(3)
        time.sleep(0.5)
        self.steps += 1
        return {"rank": rank, "item": item, "steps": self.steps, "pid": os.getpid()}

    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())

    async def slow(self, seconds: float) -> int:
        import asyncio

        await asyncio.sleep(seconds)
        return os.getpid()


class Colocated:
    def where(self, item: object) -> dict[str, object]:
        return {"rank": int(os.environ["RANK"]), "item": item, "pid": os.getpid()}


def where_packages_come_from() -> dict[str, str]:
    """Where a rank imports ktlite's server and the server's packages from."""
    import importlib

    return {
        name: str(importlib.import_module(name).__file__)
        for name in ("ktlite_server", "ktlite_wire", "fastapi", "uvicorn", "cloudpickle")
    }


def what_user_code_sees() -> dict[str, Any]:
    """What a rank process (user code) can see of its pod's security: its ids, whether the
    deployment token is in its environment or the container's first process's, the token
    file's mode, the service-account token, and which directories it can write."""
    import stat

    def _pod_server_pid() -> int:
        """The pod server's pid: this rank's parent, or its grandparent where the parent is
        the pod's rank zygote (``ktlite_server.rankzygote``)."""
        ppid = os.getppid()
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            if b"ktlite_server.rankzygote" not in f.read():
                return ppid
        with open(f"/proc/{ppid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def environ_names(pid: str) -> list[str]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return [e.split(b"=", 1)[0].decode() for e in f.read().split(b"\0") if e]
        except OSError as e:
            return [f"<unreadable: {e.strerror}>"]

    token_file = "/var/run/ktlite/token/token"  # the server's; its env names it to no rank
    mode = stat.S_IMODE(os.stat(token_file).st_mode) if os.path.exists(token_file) else None

    def writable(path: str) -> bool:
        probe = os.path.join(path, f".probe-{os.getpid()}")
        try:
            with open(probe, "w") as f:
                f.write("x")
            os.unlink(probe)
            return True
        except OSError:
            return False

    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k.startswith("Cap")}
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "env_names": sorted(os.environ),
        "pid1_env_names": environ_names("1"),
        "server_env_names": environ_names(str(_pod_server_pid())),
        "token_file_env": os.environ.get("KTLITE_TOKEN_FILE"),
        "token_file_mode": mode,
        "service_account_token": os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount"),
        "home": os.environ.get("HOME"),
        "writable": {p: writable(p) for p in (os.path.expanduser("~"), os.getcwd(), "/tmp")},
        "cap_eff": caps.get("CapEff"),
        "no_new_privs": _status_field("NoNewPrivs"),
    }


def _status_field(name: str) -> str | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return None
