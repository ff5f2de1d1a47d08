"""A pod's ``GET /status``: each rank's state, its running calls, and what it uses."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ktlite_server.ranks import RankProcess
from ktlite_server.usage import Apps, rank_gpu_summary, visible

if TYPE_CHECKING:  # the pod hands itself in; at run time this module needs no Pod
    from ktlite_server.pod import Pod


async def pod_status(pod: Pod, stuck_after: float) -> dict[str, Any]:
    """Each rank's state and what it uses; ``stuck`` marks a rank busy with one call for
    longer than ``stuck_after`` seconds (a hang in a collective, a deadlock: NeMo RL's
    stuck-worker check).

    Per rank: ``pid``, ``cpu_percent`` / ``rss_bytes`` / ``procs`` (the rank process and
    everything it started), ``calls`` (each running call's ``id`` and ``running_s``), and
    where this pod has NVML or ``nvidia-smi`` (``gpu_source`` says which): the rank's GPUs (its ``CUDA_VISIBLE_DEVICES``) with
    memory used/total and utilisation. Fields that cannot be known are None.
    ``recent_calls``: the last calls this pod ran, with each rank's outcome and end
    (:mod:`ktlite_server.callhistory`).
    """
    ranks = [r for r in pod.ranks if r is not None]
    live = [r.pid for r in ranks if r.alive and r.pid is not None]
    usage, (gpus, apps, gpu_error) = await asyncio.gather(
        pod.usage.measure(live), pod.gpu_query.snapshot()
    )
    now = time.monotonic()
    server_cvd = pod.base_env.get("CUDA_VISIBLE_DEVICES")
    rows = []
    for r in ranks:
        used = usage.get(r.pid) if r.alive and r.pid is not None else None
        row = {
            "rank": r.global_rank,
            "local_rank": r.local_rank,
            "pid": r.pid,
            "state": "busy" if r.alive and r.busy_since else ("idle" if r.alive else "dead"),
            "busy_for_s": round(now - r.busy_since, 3) if r.busy_since else None,
            "stuck": bool(r.alive and r.busy_since and now - r.busy_since > stuck_after),
            "last_exit": r.exit_code if r.exit_code is not None else r.last_exit,
            "restarts": r.restarts,
            "calls": [
                {"id": cid, "running_s": round(now - t, 3)}
                for cid, t in sorted(r.running.items(), key=lambda kv: kv[1])
            ],
            "cpu_percent": used["cpu_percent"] if used else None,
            "rss_bytes": used["rss_bytes"] if used else None,
            "procs": used["procs"] if used else None,
            "targets": sorted(r.targets),
        }
        row.update(_gpu_fields(pod, r, gpus, apps, server_cvd))
        rows.append(row)
    return {
        "pod": pod.name,
        "ordinal": pod.ordinal,
        "server_pid": os.getpid(),
        "kind": pod.dep.kind if pod.dep else None,
        "launch_id": pod.dep.launch_id if pod.dep else None,
        # how the caller laid it out: what reattaching by name (kt.fn(name=...)) needs
        "layout": {"distributed": asdict(pod.dep.config), "single": pod.dep.single}
        if pod.dep
        else None,
        "colocated": sorted(pod.colocated),
        "ranks": rows,
        "active_calls": list(pod.calls),
        "gpus": None if gpus is None else visible(gpus, server_cvd),
        "gpu_error": gpu_error,
        "gpu_source": pod.gpu_query.source,
        "engine": await pod.engine_status(),
        "recent_calls": pod.history.snapshot(),
    }


def _gpu_fields(
    pod: Pod,
    r: RankProcess,
    gpus: list[dict[str, Any]] | None,
    apps: Apps | None,
    server_cvd: str | None,
) -> dict[str, Any]:
    """The GPUs rank ``r`` sees (its CUDA_VISIBLE_DEVICES, else the server's), their memory
    and utilisation, and what the rank's own processes hold on them."""
    if gpus is None:  # no nvidia-smi on this pod
        return dict(
            gpus=None,
            gpu_memory_used_bytes=None,
            gpu_memory_total_bytes=None,
            gpu_utilization_percent=None,
            gpu_process_memory_bytes=None,
        )
    env = r.loaded_env if r.loaded_env is not None else r.env
    pids = set(pod.usage.tree_pids(r.pid)) if r.alive and r.pid is not None else set()
    return rank_gpu_summary(visible(gpus, env.get("CUDA_VISIBLE_DEVICES", server_cvd)), apps, pids)
