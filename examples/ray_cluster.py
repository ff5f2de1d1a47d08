"""A Ray cluster on ktlite pods, no operator: the seed's `run_ray_job` on 1 head + 2 workers.

Run from the repository root (needs Ray here: pip install -e ".[ray]"):

    python examples/ray_cluster.py

On the local backend the three "pods" are ktlite server processes on this machine, and
each runs one Ray node (`ray start`), so the 100 tasks spread over three Ray nodes. With
backend="kubernetes" and an image holding Ray (kt.images.ray("2.60.0-py311")), the same
code forms the cluster across three pods by their IPs.
"""

from __future__ import annotations

import collections
import time

import ktlite as kt


def run_ray_job() -> list[tuple[int, str]]:
    import ray

    ray.init(address="auto")  # RAY_ADDRESS points at the head this function runs on

    @ray.remote(num_cpus=1)
    def cpu_task(i: int) -> tuple[int, str]:
        import time

        time.sleep(0.05)
        ctx = ray.get_runtime_context()
        return i * i, ctx.get_node_id()[:8]

    refs = [cpu_task.remote(i) for i in range(100)]
    return ray.get(refs)


def main() -> None:
    compute = kt.Compute(cpus=1).distribute("ray", workers=2, worker_node_options={"cpus": 2})
    t0 = time.perf_counter()
    remote = kt.fn(run_ray_job).to(compute)  # 3 pods: the head and two worker nodes
    print(f"cluster formed and code loaded in {time.perf_counter() - t0:.1f}s")
    try:
        t0 = time.perf_counter()
        results = remote()  # one value, from the head
        print(f"100 tasks in {time.perf_counter() - t0:.2f}s")
        per_node = collections.Counter(node for _, node in results)
        for node, count in sorted(per_node.items()):
            print(f"node {node}: {count} tasks")
        assert sorted(r for r, _ in results) == sorted(i * i for i in range(100))
        head = remote.status()[0]["engine"]
        print(f"Ray nodes alive: {sum(n['alive'] for n in head['nodes'])} of {len(head['nodes'])}")
        print(f"OK: 100 results from {len(per_node)} Ray node(s)")
    finally:
        remote.teardown()


if __name__ == "__main__":
    main()
