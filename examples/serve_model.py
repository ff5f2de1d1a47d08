"""Serving a small torch model behind autoscaled replicas (local backend, CPU).

Run from the repository root (needs torch: ``pip install -e ".[examples]"`` installs it):

    python examples/serve_model.py

``kt.cls(Classifier).to(Compute(...).autoscale(...))`` puts the model behind interchangeable
replicas: each call runs on exactly one of them (the least loaded), and ktlite's autoscaler
adds replicas while calls pile up and stops them once the load has been lower for
``scale_down_delay``. A client loop keeps a number of futures in flight, in three phases
(low, high, low load), and prints how the replicas follow, with each phase's latencies.
About a minute on a laptop.
"""

from __future__ import annotations

import concurrent.futures
import time

import ktlite as kt

# (phase, calls kept in flight, pause after each call in seconds, how long in seconds)
PHASES = [("low", 1, 0.01, 8), ("high", 12, 0.0, 25), ("low again", 1, 0.01, 18)]


class Classifier:
    """A small MLP that labels a batch of feature vectors (a stand-in for a real model)."""

    def __init__(self, width: int = 128) -> None:
        import torch

        torch.set_num_threads(1)  # one replica, one core
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width),
            torch.nn.ReLU(),
            torch.nn.Linear(4 * width, 4 * width),
            torch.nn.ReLU(),
            torch.nn.Linear(4 * width, 10),
        ).eval()

    def predict(self, x):  # x: a (batch, width) float tensor
        import torch

        with torch.inference_mode():
            return self.net(x).argmax(dim=1).tolist()


def percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[max(0, round(q * len(s)) - 1)] if s else float("nan")


def replicas(remote) -> tuple[list[int], str]:
    """Calls in flight on each replica, and the autoscaler's last decision, from remote.status()."""
    status = remote.status()
    decision = status["autoscaler"]["last_decision"] or {}
    return [r["inflight"] for r in status["replicas"]], decision.get("reason", "no decision yet")


def run_phase(remote, x, name: str, inflight: int, pause: float, seconds: float, t0: float) -> None:
    """Keep up to ``inflight`` futures in flight for ``seconds`` (a new one ``pause`` seconds
    after one ends); print the replicas as they change."""
    latencies: list[float] = []
    started: dict[kt.Future, float] = {}
    shown: int | None = None
    counts: list[int] = []
    end = time.monotonic() + seconds
    next_look = 0.0
    while time.monotonic() < end or started:
        while time.monotonic() < end and len(started) < inflight:
            started[remote.predict.submit(x)] = time.monotonic()
        done, _ = concurrent.futures.wait(
            list(started), timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            fut.result()  # raises if the call failed
            latencies.append(time.monotonic() - started.pop(fut))
        if done and pause:
            time.sleep(pause)
        if time.monotonic() >= next_look:  # look at the replicas once a second
            next_look = time.monotonic() + 1.0
            per_replica, why = replicas(remote)
            counts.append(len(per_replica))
            if len(per_replica) != shown:
                shown = len(per_replica)
                print(
                    f"  t={time.monotonic() - t0:5.1f}s  {shown} replica(s), calls in flight on each: "
                    f"{per_replica}  ({why})",
                    flush=True,
                )
    print(
        f"phase {name!r} (up to {inflight} in flight, {seconds:g} s): {len(latencies)} calls, "
        f"{len(latencies) / seconds:.0f}/s, p50 {percentile(latencies, 0.5) * 1e3:.1f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1e3:.1f} ms; replicas during the phase: "
        f"{min(counts)}..{max(counts)}, at the end: {counts[-1]}\n",
        flush=True,
    )


def main() -> None:
    import torch

    compute = kt.Compute(cpus=1, memory="1Gi").autoscale(
        min_scale=1,
        max_scale=4,
        concurrency=2,  # at most 2 calls on a replica at once
        window="4s",
        scale_down_delay="6s",  # short, so that it shows within a minute
    )
    t0 = time.monotonic()
    remote = kt.cls(Classifier, name="serve-model").to(compute, init_args={"width": 128})
    print(f"deployed in {time.monotonic() - t0:.1f}s: {remote}\n")
    try:
        x = torch.randn(16, 128)
        print("one call:", remote.predict(x))
        for name, inflight, pause, seconds in PHASES:
            how = f", {pause * 1e3:g} ms apart" if pause else ""
            print(f"phase {name!r}: up to {inflight} call(s) in flight{how}, for {seconds} s")
            run_phase(remote, x, name, inflight, pause, seconds, t0)
        per_replica, why = replicas(remote)
        print(f"finally {len(per_replica)} replica(s); the autoscaler's last decision: {why}")
    finally:
        remote.teardown()
    print(f"torn down; {time.monotonic() - t0:.0f}s in all")


if __name__ == "__main__":
    main()
