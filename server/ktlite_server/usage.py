"""What a rank process uses: CPU and memory read from /proc, GPUs from NVML (``pynvml``) or
``nvidia-smi`` where present.

A rank counts with everything it started: its own session (rank processes start with
``start_new_session``) and any descendant that left it. CPU % is measured between two
samples, like ``top``: since the previous status request when that was recent, else over
a short window. A GPU query (NVML in a thread, else ``nvidia-smi``) runs with a timeout, at
most one at a time, and its answer is kept for a moment, so a ``--watch`` loop or several
callers never pile up GPU queries. Nothing here needs a package beyond the standard library
(``pynvml`` is used where the image has it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ktlite_server import nvml

CPU_WINDOW_S = 0.25  # the shortest window a CPU % is measured over
CPU_STALE_S = 30.0  # an older previous sample is not used: it would average over idle minutes
GPU_TTL_S = 1.5  # how long one nvidia-smi answer serves
GPU_TIMEOUT_S = 3.0  # an nvidia-smi that hangs (a GPU in trouble) must not hang /status
GPU_RETRY_S = 10.0  # after a failure, how long before nvidia-smi is asked again
MIB = 1 << 20

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` this module needs."""

    pid: int
    ppid: int
    session: int
    cpu_s: float  # user + system time of the process and of its reaped children
    rss_bytes: int
    start: int  # start time in clock ticks since boot: tells a reused pid apart


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/PID/stat`` line (the command name may hold spaces and parentheses)."""
    head, _, rest = text.rpartition(")")
    pid = int(head.split("(", 1)[0])
    f = rest.split()
    # f[0] is the state; the man page's field n is f[n - 3]
    cpu = sum(int(x) for x in f[11:15]) / _TICK  # utime stime cutime cstime
    return ProcStat(
        pid=pid,
        ppid=int(f[1]),
        session=int(f[3]),
        cpu_s=cpu,
        rss_bytes=int(f[21]) * _PAGE,
        start=int(f[19]),
    )


def read_procs(root: str = "/proc") -> dict[int, ProcStat]:
    """Every process this pod can see (processes that vanish while read are skipped)."""
    procs = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if not name.isdigit():
                continue
            try:
                with open(f"{root}/{name}/stat") as f:
                    st = parse_stat(f.read())
            except (OSError, ValueError, IndexError):
                continue
            procs[st.pid] = st
    return procs


def tree(pid: int, procs: dict[int, ProcStat]) -> list[ProcStat]:
    """``pid``, its session and every descendant of any of them."""
    members = {p for p, st in procs.items() if p == pid or st.session == pid}
    children: dict[int, list[int]] = {}
    for p, st in procs.items():
        children.setdefault(st.ppid, []).append(p)
    todo = list(members)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in members:
                members.add(child)
                todo.append(child)
    return [procs[p] for p in sorted(members)]


class ProcessUsage:
    """CPU %, RSS and process count of rank process trees, remembering the last sample of each."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        # (pid, start) -> (monotonic time, cpu seconds, last cpu % reported)
        self._last: dict[tuple[int, int], tuple[float, float, float | None]] = {}
        self._members: dict[int, list[int]] = {}  # pid -> its tree's pids, as last measured

    def _sample(self, pids: Iterable[int]) -> dict[int, tuple[ProcStat, list[ProcStat]]]:
        procs = read_procs(self.proc_root)
        return {pid: (procs[pid], tree(pid, procs)) for pid in pids if pid in procs}

    async def measure(self, pids: list[int]) -> dict[int, dict[str, Any]]:
        """pid -> {"cpu_percent", "rss_bytes", "procs"} for each pid that still runs."""
        now = time.monotonic()
        first = self._sample(pids)
        short = [
            pid
            for pid, (root, _) in first.items()
            if not self._usable(self._last.get((pid, root.start)), now)
        ]
        if short:  # no recent sample to measure from: take one, wait a moment, sample again
            for pid in short:
                root, members = first[pid]
                self._last[(pid, root.start)] = (now, sum(m.cpu_s for m in members), None)
            await asyncio.sleep(CPU_WINDOW_S)
            now = time.monotonic()
            first.update(self._sample(short))
        out = {}
        seen = set()
        for pid, (root, members) in first.items():
            key = (pid, root.start)
            seen.add(key)
            cpu = sum(m.cpu_s for m in members)
            when, before, reported = self._last.get(key, (now, cpu, None))
            if now - when >= CPU_WINDOW_S or (reported is None and now > when):
                percent: float | None = round(max(0.0, cpu - before) / (now - when) * 100, 1)
                self._last[key] = (now, cpu, percent)
            else:  # asked twice within a moment (two callers): the value just measured
                percent = reported
            self._members[pid] = [m.pid for m in members]
            out[pid] = {
                "cpu_percent": percent,
                "rss_bytes": sum(m.rss_bytes for m in members),
                "procs": len(members),
            }
        for key in [k for k in self._last if k not in seen]:
            del self._last[key]  # processes that are gone
        for pid in [p for p in self._members if p not in first]:
            del self._members[pid]
        return out

    def tree_pids(self, pid: int) -> list[int]:
        """The pids of ``pid``'s tree as the last ``measure`` saw them."""
        return self._members.get(pid, [pid])

    @staticmethod
    def _usable(last: tuple[float, float, float | None] | None, now: float) -> bool:
        if last is None:
            return False
        age = now - last[0]
        return age <= CPU_STALE_S and (age >= CPU_WINDOW_S or last[2] is not None)


# ---- GPUs ------------------------------------------------------------------------------------

GPU_QUERY = [
    "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
    "--format=csv,noheader,nounits",
]
APPS_QUERY = ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


def _number(text: str) -> float | None:
    """nvidia-smi's value, or None for ``[N/A]``, ``[Not Supported]`` and friends."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu``."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6 or not cells[0].isdigit():
            continue
        used, total, util = (_number(c) for c in cells[-3:])
        gpus.append(
            {
                "index": int(cells[0]),
                "uuid": cells[1],
                "name": ", ".join(cells[2:-3]),
                "memory_used_bytes": None if used is None else int(used * MIB),
                "memory_total_bytes": None if total is None else int(total * MIB),
                "utilization_percent": util,
            }
        )
    return gpus


def parse_apps(text: str) -> list[tuple[int, str, int | None]]:
    """Rows of ``nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory``: (pid, uuid, bytes)."""
    apps = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        used = _number(cells[2])
        apps.append((int(cells[0]), cells[1], None if used is None else int(used * MIB)))
    return apps


def visible(gpus: list[dict[str, Any]], cuda_visible_devices: str | None) -> list[dict[str, Any]]:
    """The GPUs a process with this ``CUDA_VISIBLE_DEVICES`` uses (unset: all of them); entries
    are indexes or (prefixes of) UUIDs, as CUDA takes them; CUDA stops at the first invalid one."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            match = [g for g in gpus if g["index"] == int(entry)]
        elif entry.startswith("GPU-"):
            match = [g for g in gpus if g["uuid"].startswith(entry)]
        else:
            match = []
        if not match:
            break
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def rank_gpu_summary(
    gpus: list[dict[str, Any]], apps: list[tuple[int, str, int | None]] | None, pids: set[int]
) -> dict[str, Any]:
    """A rank's GPUs (with what its own processes hold on each, None where ``apps`` is
    unknown) and their totals."""
    mine: list[dict[str, Any]] = []
    for g in gpus:
        held = (
            None
            if apps is None
            else sum(
                b for pid, uuid, b in apps if uuid == g["uuid"] and pid in pids and b is not None
            )
        )
        mine.append({**g, "process_memory_bytes": held})
    used = [g["memory_used_bytes"] for g in mine if g["memory_used_bytes"] is not None]
    total = [g["memory_total_bytes"] for g in mine if g["memory_total_bytes"] is not None]
    util = [g["utilization_percent"] for g in mine if g["utilization_percent"] is not None]
    return {
        "gpus": mine,
        "gpu_memory_used_bytes": sum(used) if used else None,
        "gpu_memory_total_bytes": sum(total) if total else None,
        "gpu_utilization_percent": round(sum(util) / len(util), 1) if util else None,
        "gpu_process_memory_bytes": sum(g["process_memory_bytes"] for g in mine)
        if mine and apps is not None
        else None,
    }


Apps = list[tuple[int, str, int | None]]  # (pid, GPU uuid, bytes) of nvidia-smi's compute apps
Snapshot = tuple[list[dict[str, Any]] | None, Apps | None, str | None]


class GpuQuery:
    """NVML's or ``nvidia-smi``'s answers, cached for ``GPU_TTL_S``; one query at a time.

    ``snapshot()`` returns (gpus, compute apps, error): gpus is None where this pod has
    neither NVML nor ``nvidia-smi`` on its PATH (no GPUs to report); apps is None where the processes on the
    GPUs are unknown: the query failed, or nvidia-smi names them by pids this pod cannot see
    (a container whose pid namespace it does not share); error says why a query failed.
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._at = -1e9
        self._value: Snapshot = (None, None, None)
        self._nvml = nvml.Reader()
        self.source: str | None = None  # "nvml" or "nvidia-smi": what the last answer came from

    async def snapshot(self) -> Snapshot:
        async with self._lock:
            gpus, _, error = self._value
            ttl = GPU_RETRY_S if error else GPU_TTL_S
            if time.monotonic() - self._at < ttl:
                return self._value
            self._value, self.source = await self._query()
            self._at = time.monotonic()
            return self._value

    async def _query(self) -> tuple[Snapshot, str | None]:
        if self._nvml.available:
            try:
                rows = await asyncio.wait_for(asyncio.to_thread(self._nvml), GPU_TIMEOUT_S)
            except asyncio.TimeoutError:
                return ([], None, f"NVML did not answer within {GPU_TIMEOUT_S:g}s"), "nvml"
            except RuntimeError as e:
                return ([], None, str(e)), "nvml"
            if rows is not None:
                return _own_pids(*rows), "nvml"
        exe = shutil.which("nvidia-smi")  # looked up each time: PATH is the pod's own
        if exe is None:
            return (None, None, None), None
        return await _smi(exe), "nvidia-smi"


async def _smi(exe: str) -> Snapshot:
    gpu_text, apps_text = await asyncio.gather(
        _run(exe, GPU_QUERY), _run(exe, APPS_QUERY), return_exceptions=True
    )
    if isinstance(gpu_text, BaseException):
        return [], None, str(gpu_text)
    if isinstance(apps_text, BaseException):  # the GPUs are known; only per-process memory is not
        return parse_gpus(gpu_text), None, str(apps_text)
    return _own_pids(parse_gpus(gpu_text), parse_apps(apps_text))


def _own_pids(gpus: list[dict[str, Any]], apps: Apps) -> Snapshot:
    if apps and not any(os.path.exists(f"/proc/{pid}") for pid, _, _ in apps):
        return gpus, None, None  # another pid namespace's pids
    return gpus, apps, None


async def _run(exe: str, args: list[str]) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        raise RuntimeError(f"nvidia-smi could not start: {e}") from e
    try:
        out, err = await asyncio.wait_for(proc.communicate(), GPU_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RuntimeError(f"nvidia-smi did not answer within {GPU_TIMEOUT_S:g}s") from None
    finally:
        if proc.returncode is None:  # timed out, or its sibling query failed: never leave it
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(proc.wait(), 1.0)
    if proc.returncode != 0:
        text = (err or out).decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError(
            f"nvidia-smi {args[0].split('=')[0]} exited with code {proc.returncode}"
            + (f": {text[-1][:200]}" if text else "")
        )
    return out.decode("utf-8", "replace")
