"""A deployment's status as people read it: one row per rank (``ktlite status NAME``).

The data comes from each pod server's ``GET /status`` (``remote.status()``); this module
only flattens and formats it, so the command line and ``ktlite.groups`` show the same thing.
"""

from __future__ import annotations

import time
from typing import Any

COLUMNS = [
    "RANK",
    "POD",
    "PID",
    "STATE",
    "CPU%",
    "RSS",
    "GPU MEM",
    "GPU%",
    "CALL",
    "RUNNING",
    "RESTARTS",
]


def rank_rows(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank of every pod, in rank order, each with its pod's name under ``pod``."""
    rows = [{**r, "pod": pod["pod"]} for pod in pods for r in pod.get("ranks", [])]
    return sorted(rows, key=lambda r: r["rank"])


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _state(r: dict[str, Any]) -> str:
    if r.get("stuck"):
        return "STUCK"
    if r["state"] == "dead" and r.get("last_exit") is not None:
        return f"dead({r['last_exit']})"
    return str(r["state"])


def _gpu_mem(r: dict[str, Any]) -> str:
    used, total = r.get("gpu_memory_used_bytes"), r.get("gpu_memory_total_bytes")
    if used is None or total is None:
        return "-"
    return f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"


def _cells(r: dict[str, Any]) -> list[str]:
    calls = r.get("calls") or []
    call = "-"
    running = r.get("busy_for_s")
    if calls:
        call = str(calls[0]["id"])[:12] + (f" +{len(calls) - 1}" if len(calls) > 1 else "")
        running = max(c["running_s"] for c in calls)
    cpu = r.get("cpu_percent")
    util = r.get("gpu_utilization_percent")
    return [
        str(r["rank"]),
        str(r["pod"]),
        str(r.get("pid") or "-"),
        _state(r),
        "-" if cpu is None else f"{cpu:.1f}",
        fmt_bytes(r.get("rss_bytes")),
        _gpu_mem(r),
        "-" if util is None else f"{util:.0f}",
        call,
        fmt_seconds(running),
        str(r.get("restarts", 0)),
    ]


def table(name: str, pods: list[dict[str, Any]]) -> str:
    """The deployment's summary line, then one row per rank."""
    launches = sorted({str(p.get("launch_id")) for p in pods if "error" not in p})
    active = sorted({c for p in pods for c in p.get("active_calls", [])})
    rows = rank_rows(pods)
    head = (
        f"{name}: {len(pods)} pod(s), {len(rows)} rank(s), launch {', '.join(launches) or '-'}, "
        f"{len(active)} active call(s)"
    )
    errors = [f"  {p['pod']}: not answering: {p['error']}" for p in pods if p.get("error")]
    errors += [
        f"  {p['pod']}: GPU query failed: {p['gpu_error']}" for p in pods if p.get("gpu_error")
    ]
    cells = [COLUMNS] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    numeric = {"RANK", "PID", "CPU%", "RSS", "GPU MEM", "GPU%", "RUNNING", "RESTARTS"}
    lines = []
    for c in cells:
        lines.append(
            "  ".join(
                (v.rjust(w) if col in numeric else v.ljust(w))
                for v, w, col in zip(c, widths, COLUMNS, strict=True)
            ).rstrip()
        )
    return "\n".join([head, *errors, *lines])


def stuck_ranks(pods: list[dict[str, Any]]) -> list[int]:
    return [r["rank"] for r in rank_rows(pods) if r.get("stuck")]


def serving(
    name: str, config: dict[str, Any], scaling: dict[str, Any] | None, pods: list[dict[str, Any]]
) -> str:
    """An autoscaled deployment: its replicas with their calls in flight, and the
    autoscaler's bounds, target and last decision with its reason."""
    bounds = f"{config.get('min_scale') or 0}..{config.get('max_scale') or 'no limit'}"
    lines = [
        f"{name}: autoscaled, {len(pods)} replica(s) running ({bounds}), metric "
        f"{_metric(config, scaling)}"
        + (
            f", at most {config['concurrency']} calls per replica"
            if config.get("concurrency")
            else ""
        )
    ]
    for p in pods:
        state = (
            f"not answering: {p['error']}"
            if p.get("error")
            else f"{len(p.get('active_calls') or [])} call(s) in flight, launch {p.get('launch_id') or '-'}"
        )
        lines.append(f"  replica {p['pod']}: {state}")
    if not pods:
        lines.append("  no replica runs (scaled to zero): the next call starts one")
    if scaling is None:
        lines.append(
            "  autoscaler: no decision recorded yet (ktlite's autoscaler runs in the process that calls "
            "the service)"
        )
        return "\n".join(lines)
    who = scaling.get("autoscaler", "?")
    if scaling.get("alive") is False:
        who += " (that process has exited: nothing scales until a client calls again)"
    lines.append(f"  autoscaler: {who}")
    last = scaling.get("last_decision")
    if last:
        when = last.get("wall_time")
        ago = f" {fmt_seconds(time.time() - when)} ago" if isinstance(when, (int, float)) else ""
        lines.append(
            f"  last decision{ago}: {last.get('current')} -> {last.get('desired')} replica(s): "
            f"{last.get('reason')}"
        )
    for c in scaling.get("conditions") or []:  # a cluster autoscaler's (an HPA's) own words
        lines.append(
            f"  {c.get('type')}={c.get('status')} {c.get('reason') or ''}: {c.get('message') or ''}"
        )
    if scaling.get("error"):
        lines.append(f"  error: {scaling['error']}")
    return "\n".join(lines)


def _metric(config: dict[str, Any], scaling: dict[str, Any] | None) -> str:
    """What the autoscaler scales on: the cluster's own metric where it reports one (an HPA
    scales on CPU where the metric asked for needs a custom-metrics adapter the cluster
    lacks), else the metric asked for (ktlite's own autoscaler)."""
    said = (scaling or {}).get("metric")
    if not isinstance(said, dict) or not said.get("name"):
        return str(config.get("metric") or "concurrency")
    parts = [
        f"target {said['target']}" if said.get("target") is not None else "",
        f"now {said['current']}" if said.get("current") is not None else "",
    ]
    text = f"{said['name']}" + (f" ({', '.join(p for p in parts if p)})" if any(parts) else "")
    if said.get("instead_of"):
        text += (
            f", instead of {said['instead_of']} (asked for, but it needs a custom-metrics adapter, "
            "which this cluster lacks)"
        )
    return text
