"""distribute("ray") on a real cluster: a head and two worker nodes formed by the pod servers
by pod IP (no operator, no DNS), the seed's job across them, a task's error with its type,
and nothing of Ray left after teardown. Needs an image with Ray at this client's version
(KTLITE_TEST_RAY_IMAGE; images/Dockerfile with --build-arg PIP_EXTRA="ray[default]==X")."""

from __future__ import annotations

import pytest
from conftest import NAME_LABEL

import ktlite as kt


def ray_job(n: int = 40) -> list[tuple[int, str]]:
    import ray

    ray.init(address="auto")

    @ray.remote(num_cpus=0.1)
    def task(i: int) -> tuple[int, str]:
        import time

        time.sleep(0.05)
        return i, ray.get_runtime_context().get_node_id()

    return ray.get([task.remote(i) for i in range(n)])


def ray_failing_job() -> None:
    import ray

    ray.init()
    ray.get(ray.remote(lambda: {}["missing"]).remote())


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_ray_cluster_across_pods(settings, deployments, make_compute, kube):
    pytest.importorskip("ray")
    if not settings.ray_image:
        pytest.skip("KTLITE_TEST_RAY_IMAGE is empty")
    name = deployments.name("ray")
    compute = make_compute(
        settings.ray_image, cpus="250m", memory="1Gi", launch_timeout=480
    ).distribute("ray", workers=2, worker_node_options={"cpus": "300m", "memory": "1Gi"})
    deployments.names.append(name)
    remote = kt.fn(ray_job).to(compute, name=name)
    deployments.remotes.append(remote)
    results = remote()
    assert sorted(i for i, _ in results) == list(range(40))
    head = remote.status()[0]["engine"]
    assert sum(n["alive"] for n in head["nodes"]) == 3 and head["lost"] == []
    ips = sorted(p.status.pod_ip for p in kube.pods(name))  # the nodes are the pods, by IP
    assert sorted(n["ip"] for n in head["nodes"]) == ips
    sets = sorted(
        s.metadata.name
        for s in kube.apps.list_namespaced_stateful_set(
            kube.namespace, label_selector=f"{NAME_LABEL}={name}"
        ).items
    )
    assert sets == [name, f"{name}-s1"]  # the head and the worker nodes, sized apart
    failing = kt.fn(ray_failing_job).to(compute, name=name)
    with pytest.raises(KeyError, match="missing"):
        failing()
