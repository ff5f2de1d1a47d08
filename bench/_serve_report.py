"""``bench_serve.py``'s table: each cell's requests/s and latencies per system, ktlite's ratios
to the others, the throughput target of issue 14 and the rows where calls were not served in
arrival order. ``measured`` maps "system/replicas/inflight" to a row of ``_serve_peers.drive``."""

from __future__ import annotations

INFLIGHT = (1, 8, 32)
REPLICAS = (1, 4)
TARGET = 0.8  # issue 14: ktlite >= 0.8x the plain server's throughput per replica


LABEL = {"ktlite": "ktlite", "floor": "floor", "ray": "Ray"}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = [
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def table(measured: dict[str, dict[str, float]], systems: list[str]) -> str:
    header = ["replicas", "in flight"]
    for s in systems:
        header += [f"{LABEL[s]} req/s", "p50", "p99"]
    if "ktlite" in systems:
        header += [
            f"kt/{LABEL[s]} {what}" for s in systems if s != "ktlite" for what in ("rps", "p50")
        ]
    rows = []
    for r in REPLICAS:
        for n in INFLIGHT:
            row = [str(r), str(n)]
            got = {s: measured.get(f"{s}/{r}/{n}") for s in systems}
            for s in systems:
                v = got[s]
                row += (
                    ["-", "-", "-"]
                    if v is None
                    else [f"{v['rps']:,.0f}", ms(v["p50"]), ms(v["p99"])]
                )
            if "ktlite" in systems:
                k = got["ktlite"]
                for s in systems:
                    if s == "ktlite":
                        continue
                    v = got[s]
                    ok = k is not None and v is not None and v["rps"] > 0 and v["p50"] > 0
                    row += (
                        [f"{k['rps'] / v['rps']:.2f}", f"{k['p50'] / v['p50']:.2f}"]
                        if ok
                        else ["-", "-"]
                    )
            rows.append(row)
    return render(rows, header)


def fairness(measured: dict[str, dict[str, float]]) -> list[str]:
    """Rows where one load thread got far fewer calls done than another: calls waiting for
    a replica were not served in the order they came."""
    out = []
    for key, v in measured.items():
        most, fewest = v.get("most_per_thread", 0), v.get("fewest_per_thread", 0)
        if most >= 8 and fewest < most / 4:
            system, r, n = key.split("/")
            out.append(
                f"{LABEL[system]}, {r} replica(s), {n} in flight: one load thread finished "
                f"{fewest:.0f} call(s) in the window, another {most:.0f}"
            )
    return out


def verdict(measured: dict[str, dict[str, float]]) -> str | None:
    ratios = []
    for r in REPLICAS:
        for n in INFLIGHT:
            k, f = measured.get(f"ktlite/{r}/{n}"), measured.get(f"floor/{r}/{n}")
            if k and f and f["rps"] > 0:
                ratios.append((k["rps"] / f["rps"], r, n))
    if not ratios:
        return None
    met = sum(1 for q, _, _ in ratios if q >= TARGET)
    worst = min(ratios)
    return (
        f"target: ktlite >= {TARGET}x the plain server's throughput per replica: met in {met} of "
        f"{len(ratios)} rows (lowest {worst[0]:.2f}x at {worst[1]} replica(s), {worst[2]} in flight)"
    )
