"""The table and the issue-26 verdicts ``bench_scale.py`` prints from its rows."""

from __future__ import annotations

import os
from typing import Any

PROCS = 8  # ranks per simulated pod
TARGETS = {"p50_ms": 20.0, "p99_ms": 100.0, "push_s": 2.0, "dead_s": 5.0, "client_mb": 200.0}


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec) if isinstance(v, float) else str(v)


COLUMNS = [
    ("pods", "pods", "d"),
    ("ranks", "ranks", "d"),
    ("tree", "tree", ""),
    (".to() s", "to_s", ".2f"),
    ("push s", "push_s", ".2f"),
    ("push: pods CPU s", "push_cpu_s", ".2f"),
    ("push: serial CPU ms", "push_serial_cpu_ms", ".1f"),
    ("no-op p50 ms", "noop_p50_ms", ".1f"),
    ("no-op p99 ms", "noop_p99_ms", ".1f"),
    ("1 KB p50 ms", "kb_p50_ms", ".1f"),
    ("per-rank ms", "each_p50_ms", ".1f"),
    ("logs ms", "logs_ms", ".1f"),
    ("log lines", "log_lines", ""),
    ("cancel s", "cancel_s", ".2f"),
    ("cancel: pods CPU s", "cancel_cpu_s", ".2f"),
    ("dead pod s", "dead_s", ".2f"),
    ("client CPU ms/call", "client_cpu_ms", ".2f"),
    ("pod 0 CPU ms/call", "pod0_cpu_ms", ".2f"),
    ("pod 1 CPU ms/call", "pod1_cpu_ms", ".2f"),
    ("serial CPU ms/call", "serial_cpu_ms", ".1f"),
    ("path p50 ms", "path_p50_ms", ".1f"),
    ("path p99 ms", "path_p99_ms", ".1f"),
    ("path: its wall p50 ms", "path_wall_p50_ms", ".1f"),
    ("path: idle taken out ms", "path_idle_ms", ".1f"),
    ("all pods CPU ms/call", "host_cpu_ms", ".1f"),
    ("client MB", "client_mb", ".0f"),
]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    out = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [
            _fmt(r.get(key), spec) if spec else str(r.get(key, "n/a")) for _, key, spec in COLUMNS
        ]
        cells[-1] += f" ({r.get('client_peak_mb', 0):.0f})"
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each issue-26 target for this harness: met / not met, and the cause of a miss."""
    base = next((r for r in rows if r["pods"] == 1), None)
    big = max(rows, key=lambda r: r["pods"])
    cores = os.cpu_count() or 1
    out = []
    if base is not None and big["pods"] > 1:
        for q, key in (("p50", "noop_p50_ms"), ("p99", "noop_p99_ms")):
            out += _latency_verdicts(q, base, big, key, cores)
    for key, what in (("push_s", "code push to all"), ("dead_s", "a dead pod named")):
        v, bound = big[key], TARGETS[key]
        ok = v <= bound and (key != "dead_s" or big["dead_named"])
        extra = "" if key != "dead_s" or big["dead_named"] else " (the error did not name it)"
        if key == "push_s":
            extra = (
                f"; the pods spent {big['push_cpu_s']:.2f} s of CPU on it, on {cores} cores here "
                f"({big['push_cpu_s'] / big['pods'] * 1000:.1f} ms each on a cluster)"
            )
            if big.get("push_serial_cpu_ms") is not None:
                extra += (
                    f", {big['push_serial_cpu_ms']:.0f} ms of it along its longest path (the "
                    "client, pod 0, a relay per level, a member)"
                )
            if not ok:
                extra = "; cause:" + extra[1:]
        out.append(
            f"{what} at {big['pods']} pods: {v:.2f} s (target <= {bound:g} s): "
            f"{'met' if ok else 'not met'}{extra}"
        )
    peak = max(r["client_peak_mb"] for r in rows)
    out.append(
        f"client memory: peak {peak:.0f} MB (target <= {TARGETS['client_mb']:g} MB): "
        f"{'met' if peak <= TARGETS['client_mb'] else 'not met'}"
    )
    return out


def _latency_verdicts(
    q: str, base: dict[str, Any], big: dict[str, Any], key: str, cores: int
) -> list[str]:
    """The no-op call's target at ``q``: on the longest path (measured with its processes
    unthrottled, ``_scale_path.py``), and in plain wall time here."""
    bound = TARGETS[f"{q}_ms"]
    at = f"{big['pods']} x {PROCS}"
    out = []
    path_key = f"path_{q}_ms"
    if big.get(path_key) is not None and base.get(path_key) is not None:
        over = big[path_key] - base[path_key]
        out.append(
            f"no-op call {q} at {at} on the call's longest path: {over:+.1f} ms over 1 pod "
            f"(target <= {bound:g} ms): {'met' if over <= bound else 'not met'} on the longest "
            "path's measured time (the client, pod 0 and relay pod 1 pinned to one core, pod "
            "1's leaves to the other, every other pod at nice 19; the wall time less "
            f"pod 0's and pod 1's idle wait, {big['path_idle_ms']:.0f} ms at p50, for the "
            "branches off the path, which a cluster runs alongside: _scale_path.py)"
        )
    over = big[key] - base[key]
    cause = ""
    if over > bound:
        cause = (
            f"; cause: the {big['pods']} pod servers share {cores} cores here, and a call costs "
            f"them {big['host_cpu_ms']:.0f} ms of CPU in all (a cluster spreads it over "
            f"{big['pods']} machines: {big['host_cpu_ms'] / big['pods']:.2f} ms each): not "
            f"measurable in wall time on {cores} cores"
        )
        serial = big.get("serial_cpu_ms")
        if serial is not None and q == "p50":
            cause += (
                f"; the call's CPU along its longest path (the client, pod 0, a relay per level, "
                f"a member) is {serial:.1f} ms"
            )
    out.append(
        f"no-op call {q} at {at} in wall time here: {over:+.1f} ms over 1 pod (target <= "
        f"{bound:g} ms): {'met' if over <= bound else 'not met'}{cause}"
    )
    return out
