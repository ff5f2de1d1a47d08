"""Helpers for the hostile-input, bad-input and soak tests: looking at processes from outside.

Everything here reads ``/proc`` (Linux): child processes, threads, file descriptors, TCP
sockets by state, zombies, and the pods of a local deployment. No mocks, no server API:
what a leak would look like to ``ps``/``lsof``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TCP_STATES = {"01": "established", "0A": "listen"}


def local_dir(name: str) -> Path:
    return Path(os.environ["KTLITE_HOME"]) / "local" / name


def read_state(name: str) -> dict[str, Any]:
    """The local backend's ``state.json`` of a deployment, plus ``urls``."""
    with open(local_dir(name) / "state.json") as f:
        state: dict[str, Any] = json.load(f)
    state["urls"] = [f"http://127.0.0.1:{p['port']}" for p in state["pods"]]
    return state


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, ...]


def ppid_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def state_of(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def alive(pid: int | None) -> bool:
    """Runs (a zombie or a reaped pid does not)."""
    return bool(pid) and state_of(pid) not in (None, "Z", "X")  # type: ignore[arg-type]


def all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children list), zombies included."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return sorted(set(out))


def is_zygote(pid: int) -> bool:
    """Whether ``pid`` is a pod server's rank zygote (``ktlite_server.rankzygote``)."""
    try:
        return b"ktlite_server.rankzygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def zygotes(server: int) -> list[int]:
    """The rank zygotes of pod server ``server`` (one, once it started a rank)."""
    return [c for c in children(server) if is_zygote(c)]


def rank_processes(server: int) -> list[int]:
    """The rank processes of pod server ``server``: forked by its zygote, or (where ranks
    start as new processes) its own children."""
    out: list[int] = []
    for c in children(server):
        out += children(c) if is_zygote(c) else [c]
    return out


def zombies(parents: Iterable[int]) -> list[int]:
    """Zombie children of any of ``parents``."""
    return [c for p in parents for c in children(p) if state_of(c) == "Z"]


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def fd_targets(pid: int) -> list[str]:
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in names:
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def _tcp_inodes(pid: int) -> dict[str, str]:
    """socket inode -> TCP state name, for the network namespace of ``pid``."""
    out: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9:
                out[parts[9]] = _TCP_STATES.get(parts[3], "tcp-other")
    return out


@dataclass
class Usage:
    """What one process holds."""

    pid: int
    children: int
    threads: int
    fds: int
    pipes: int
    listen: int
    established: int
    tcp_other: int
    other_sockets: int  # unix socketpairs and the like

    def row(self) -> dict[str, int]:
        return {
            "children": self.children,
            "threads": self.threads,
            "fds": self.fds,
            "pipes": self.pipes,
            "non_pipe_fds": self.fds - self.pipes,
            "listen": self.listen,
            "established": self.established,
            "tcp_other": self.tcp_other,
            "other_sockets": self.other_sockets,
        }


def usage(pid: int) -> Usage:
    targets = fd_targets(pid)
    tcp = _tcp_inodes(pid)
    counts = {"listen": 0, "established": 0, "tcp-other": 0, "other": 0}
    for t in targets:
        if t.startswith("socket:["):
            kind = tcp.get(t[len("socket:[") : -1], "other")
            counts[kind] += 1
    return Usage(
        pid=pid,
        children=len(children(pid)),
        threads=threads(pid),
        fds=len(targets),
        pipes=sum(t.startswith("pipe:") for t in targets),
        listen=counts["listen"],
        established=counts["established"],
        tcp_other=counts["tcp-other"],
        other_sockets=counts["other"],
    )


def total(rows: Iterable[Usage]) -> dict[str, int]:
    out: dict[str, int] = {}
    n = 0
    for r in rows:
        n += 1
        for k, v in r.row().items():
            out[k] = out.get(k, 0) + v
    out["processes"] = n
    return out


def pod_pids(name: str) -> list[int]:
    """Running ``ktlite_server`` processes of deployment ``name`` of this test session (their
    ``--ready-file`` lies in this session's ``$KTLITE_HOME``: other sessions may use the name)."""
    found = []
    prefix = str(local_dir(name)).encode() + b"/"
    for pid in all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ktlite_server" not in argv or b"--ready-file" not in argv:
            continue
        i = argv.index(b"--ready-file") + 1
        if i < len(argv) and argv[i].startswith(prefix) and alive(pid):
            found.append(pid)
    return sorted(found)


def with_env(entry: str) -> list[int]:
    """Running processes whose environment holds ``entry`` (``NAME=value``)."""
    needle = entry.encode()
    found = []
    for pid in all_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and alive(pid):
            found.append(pid)
    return sorted(found)


def listen_ports_of(pid: int) -> set[int]:
    """Ports ``pid`` listens on."""
    mine = {t[len("socket:[") : -1] for t in fd_targets(pid) if t.startswith("socket:[")}
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[9] in mine and parts[3] == "0A":
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def shm_files() -> set[str]:
    d = Path("/dev/shm")
    return {p.name for p in d.iterdir() if p.name.startswith("ktlite-")} if d.is_dir() else set()


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def tcp_peer_ports(pid: int) -> list[int]:
    """Remote ports of the TCP sockets ``pid`` holds open (any state but LISTEN)."""
    mine = {t[len("socket:[") : -1] for t in fd_targets(pid) if t.startswith("socket:[")}
    out = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[9] in mine and parts[3] != "0A":
                out.append(int(parts[2].rsplit(":", 1)[1], 16))
    return sorted(out)
