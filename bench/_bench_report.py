"""``bench.py``'s samples turned into its report: summaries, the table of ratios against the
peers, and the targets of the design issue (reported, never asserted)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from _rounds import LoadLog


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(samples)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def lat_summary(samples: list[float]) -> dict[str, Any]:
    return {
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "mean": statistics.fmean(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def reps_summary(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "best": min(samples), "samples": samples}


def rate_summary(samples: list[float]) -> dict[str, Any]:
    return {"best": max(samples), "median": statistics.median(samples), "samples": samples}


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f} MB/s"


def table(m: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """(rows of measurement, ktlite, peer, peer value, ratio; rows of target, measured, met)."""
    rows: list[list[str]] = []

    def get(key: str, stat: str) -> float | None:
        v = m.get(key)
        return None if v is None else v.get(stat)

    def add(
        what: str,
        kv: float | None,
        peer: str,
        pv: float | None,
        fmt: Callable[[float | None], str],
        extra: str = "",
    ) -> None:
        ratio = "-" if kv is None or pv is None or not pv else f"{kv / pv:.2f}"
        rows.append([what, fmt(kv), peer, fmt(pv), ratio + extra])

    for stat in ("p50", "p99"):
        kv = get("kt_warm_call", stat)
        add(
            f"warm call {stat} (1 worker, no-op)",
            kv,
            "raw FastAPI+httpx+cloudpickle",
            get("raw_fastapi", stat),
            fmt_time,
        )
        add(
            f"warm call {stat} (1 worker, no-op)",
            kv,
            "Ray actor call",
            get("ray_actor_call", stat),
            fmt_time,
        )
    for shape, n in (("2x1", 2), ("4x1", 4), ("2x2", 4)):
        for stat in ("p50", "p99"):
            add(
                f"{n}-rank call {stat} ({shape}, spmd no-op)",
                get(f"kt_dist_{shape}", stat),
                f"Ray fan-out to {n} actors",
                get(f"ray_fanout_{shape}", stat),
                fmt_time,
            )
    cold, ray_init = get("kt_cold_total", "median"), m.get("ray_init_s")
    rows.append(
        [
            "cold .to() -> first result (1 worker)",
            fmt_time(cold),
            "ray.init + 4 actors + first call (ref)",
            fmt_time(ray_init),
            "-" if ray_init is None or cold is None else f"{cold / ray_init:.2f}",
        ]
    )
    tr = get("torchrun_launch", "median")
    add(
        "cold .to() + first 4-rank gloo call (2x2)",
        get("kt_gloo_cold_total", "median"),
        "torchrun launch, 4 ranks",
        tr,
        fmt_time,
    )
    warm = get("kt_gloo_warm", "median")
    add(
        "warm re-run, 4-rank gloo job (2x2)",
        warm,
        "torchrun launch, 4 ranks",
        tr,
        fmt_time,
        f" ({tr / warm:.0f}x faster)" if warm and tr else "",
    )
    rows.append(
        [
            "redeploy after a code change: .to()",
            fmt_time(get("kt_redeploy_to", "median")),
            "-",
            "-",
            "-",
        ]
    )
    rows.append(
        [
            "redeploy: first call after it (no-op)",
            fmt_time(get("kt_redeploy_first_call", "median")),
            "-",
            "-",
            "-",
        ]
    )
    tcp = get("loopback_tcp_mbps", "best")
    for kind in ("numpy", "torch"):
        for direction, label in (("arg", "argument"), ("result", "result")):
            add(
                f"100 MB {kind} as {label}",
                get(f"kt_{kind}_{direction}_mbps", "best"),
                "loopback TCP (100 MB)",
                tcp,
                fmt_rate,
            )
    return rows, targets(m, get)


def targets(m: dict[str, Any], get: Callable[[str, str], float | None]) -> list[list[str]]:
    out: list[list[str]] = []

    def target(what: str, ok: bool | None, measured: str) -> None:
        out.append([what, measured, "n/a" if ok is None else ("yes" if ok else "NO")])

    p50 = get("kt_warm_call", "p50")
    target("warm call p50 <= 1.5 ms", None if p50 is None else p50 <= 1.5e-3, fmt_time(p50))
    ray1 = get("ray_actor_call", "p50")
    target(
        "warm call p50 <= Ray actor call p50",
        None if p50 is None or ray1 is None else p50 <= ray1,
        f"{fmt_time(p50)} vs {fmt_time(ray1)}",
    )
    for shape in ("4x1", "2x2"):
        k4, ray4 = get(f"kt_dist_{shape}", "p50"), get(f"ray_fanout_{shape}", "p50")
        target(
            f"4-rank call ({shape}) p50 <= Ray 4-actor fan-out p50",
            None if k4 is None or ray4 is None else k4 <= ray4,
            f"{fmt_time(k4)} vs {fmt_time(ray4)}",
        )
    for direction in ("arg", "result"):
        r = get(f"kt_torch_{direction}_mbps", "best")
        target(
            f"100 MB tensor as {direction} >= 1 GB/s", None if r is None else r >= 1000, fmt_rate(r)
        )
    rd = get("kt_redeploy_to", "median")
    target("redeploy < 1 s", None if rd is None else rd < 1.0, fmt_time(rd))
    warm, tr = get("kt_gloo_warm", "median"), get("torchrun_launch", "median")
    target(
        "warm gloo re-run >= 20x faster than torchrun launch",
        None if warm is None or tr is None else tr / warm >= 20,
        "-" if warm is None or tr is None else f"{tr / warm:.0f}x",
    )
    cold = get("kt_gloo_cold_total", "median")
    target(
        "cold .to() + first 4-rank call <= torchrun launch",
        None if cold is None or tr is None else cold <= tr,
        f"{fmt_time(cold)} vs {fmt_time(tr)}",
    )
    return out


def render(rows: list[list[str]], header: list[str], left: tuple[int, ...] = (0, 2)) -> str:
    """``rows`` under ``header`` in aligned columns: the ``left`` ones flush left, the others right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    out += [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(out)


def show(
    title: str, m: dict[str, Any], load: LoadLog, notes: list[str]
) -> tuple[list[list[str]], list[list[str]]]:
    """Print the report: title, load, the table, the targets, the load of each step, notes."""
    rows, met = table(m)
    print(title)
    print(load.summary())
    print("ratio = ktlite / peer: below 1 is faster for times, above 1 is faster for MB/s\n")
    print(render(rows, ["measurement", "ktlite", "peer", "peer value", "ratio"]))
    print()
    print(render(met, ["target", "measured", "met"]))
    print("\nload average (1 min) before -> after each round or step:")
    for line in load.lines():
        print(f"  {line}")
    if notes:
        print("\nnotes:")
        for n in notes:
            print(f"- {n}")
    return rows, met
