"""distribute("monarch") on a real cluster: every pod's server runs Monarch's worker loop on
its pod IP (no DNS), the controller on pod 0 spawns procs on every pod and calls an endpoint
on each, an endpoint's error keeps its type, and the NetworkPolicy that guards the loops'
port comes and goes with the deployment. Needs an image with torchmonarch
(KTLITE_TEST_MONARCH_IMAGE; images/Dockerfile with --build-arg PIP_EXTRA=torchmonarch==X)."""

from __future__ import annotations

import pytest
from conftest import NAME_LABEL


def mesh_job(x: int) -> list[dict]:
    import os
    import socket

    from monarch.actor import Actor, endpoint

    from ktlite.distributed import monarch_procs

    class Where(Actor):
        @endpoint
        def where(self, x: int) -> dict:
            return {"host": socket.gethostname(), "pid": os.getpid(), "x2": x * 2}

    procs = monarch_procs()
    try:
        return [
            {"point": dict(p), **v}
            for p, v in procs.spawn("where", Where).where.call(x).get().items()
        ]
    finally:
        procs.stop().get()


def mesh_failing_job() -> None:
    from monarch.actor import Actor, endpoint

    from ktlite.distributed import monarch_procs

    class Bad(Actor):
        @endpoint
        def boom(self) -> None:
            raise KeyError("missing")

    procs = monarch_procs(per_host={"gpus": 1})
    try:
        procs.spawn("bad", Bad).boom.call().get()
    finally:
        procs.stop().get()


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_monarch_mesh_across_pods(settings, deployments, make_compute, kube):
    if not settings.monarch_image:
        pytest.skip("KTLITE_TEST_MONARCH_IMAGE is empty")
    name = deployments.name("mesh")
    compute = make_compute(
        settings.monarch_image, cpus="250m", memory="1Gi", launch_timeout=480
    ).distribute("monarch", workers=2, num_proc=2)
    # guarded before the pods exist: the loops' port has no authentication
    policies = [o.metadata.name for o in kube.list("networkpolicies", f"{NAME_LABEL}={name}")]
    assert policies == [], policies
    remote = deployments.to(mesh_job, compute, name)
    assert [o.metadata.name for o in kube.list("networkpolicies", f"{NAME_LABEL}={name}")] == [name]
    rows = remote(21)
    pods = [p.metadata.name for p in kube.pods(name)]
    assert len(rows) == 4 and all(r["x2"] == 42 for r in rows)
    # host k of the mesh is pod k (its hostname is the pod's name)
    assert sorted((r["point"]["hosts"], r["host"]) for r in rows) == sorted(
        (k, pod) for k, pod in enumerate(pods) for _ in range(2)
    )
    head = remote.status()[0]["engine"]
    ips = [p.status.pod_ip for p in kube.pods(name)]
    assert [h["address"].split("//")[1].rsplit(":", 1)[0] for h in head["hosts"]] == ips  # by IP
    assert head["lost"] == []
    failing = deployments.to(mesh_failing_job, compute, name)
    with pytest.raises(KeyError, match="missing"):
        failing()
    failing.teardown()
    assert kube.wait_gone(f"{NAME_LABEL}={name}", timeout=120) == {}
