"""Issue 13 on a real cluster: a Kubetorch user's code, with only the import changed (opt-in).

The same forms as tests/test_kubetorch_compat.py, where the cluster matters: a Compute
distributed by ``compute.distribute(...)`` alone, Kubetorch's field spellings rendered onto
real pods, reattaching by name from a fresh handle, and ``workers=`` by pod IP.
"""

from __future__ import annotations

import cluster_funcs
import pytest

import ktlite as kt

pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_kubetorch_forms_on_real_pods(deployments, make_compute, kube, settings, monkeypatch):
    name = deployments.name("kubetorch")
    compute = make_compute(
        gpus=None,
        tolerations=None,
        priority_class_name=None,
        service_account_name=None,
        disk_size="1Gi",
        working_dir="/tmp",
        labels={"team": "ml"},
    )
    compute.distribute("spmd", workers=2)  # not assigned: Kubetorch's distribute changes compute
    remote = deployments.to(cluster_funcs.whoami, compute, name)
    out = remote(1)
    assert [o["env"]["RANK"] for o in out] == ["0", "1"]
    pods = kube.pods(name)
    assert [p.metadata.labels["team"] for p in pods] == ["ml", "ml"]
    container = pods[0].spec.containers[0]
    assert container.working_dir == "/tmp"
    assert container.resources.requests["ephemeral-storage"] == "1Gi"

    ips = [p.status.pod_ip for p in pods]
    by_ip = remote(2, workers=[ips[1]])
    assert [o["hostname"] for o in by_ip] == [f"{name}-1"]
    assert [o["hostname"] for o in remote(2, workers="any")] == [f"{name}-0"]
    assert len(remote(2, workers="ready")) == 2

    # a handle from "another process": no code here, attached by name, where kt.config points
    monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
    monkeypatch.setenv("KTLITE_NAMESPACE", settings.namespace)
    again = kt.fn(name=name)
    assert [o["value"] for o in again(5)] == [10, 10]
    remote.serialization = "json"
    assert isinstance(remote(3)[0]["env"], dict)
