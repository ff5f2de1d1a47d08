"""``inactivity_ttl`` on a real cluster: an idle deployment is torn down, all its objects.

Where pods reach the API server, pod 0 deletes the deployment itself; where they cannot (a
cluster without kube-proxy, as ``../shared/cluster``), the next ``ktlite list`` does. The
test works either way: it runs ``ktlite list`` until nothing of the deployment is left.
"""

from __future__ import annotations

import time

import cluster_funcs
import pytest
from conftest import NAME_LABEL, WITHOUT_VOLUMES

from ktlite.commands import cli

ACCESS = ("serviceaccounts", "roles", "rolebindings")


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_an_idle_deployment_is_torn_down(deployments, make_compute, kube, settings, capsys):
    name = deployments.name("ttl")
    remote = deployments.to(cluster_funcs.job, make_compute(workers=2, inactivity_ttl=5), name)
    assert remote("rank") == [0, 1]
    selector = f"{NAME_LABEL}={name}"
    assert kube.remaining(selector, ACCESS) == {kind: [f"{name}-ttl"] for kind in ACCESS}
    deadline = time.monotonic() + 300
    swept = False
    while left := kube.remaining(selector, WITHOUT_VOLUMES):
        assert time.monotonic() < deadline, f"still there 300 s after its last call: {left}"
        assert cli.main(["list", "--backend", "kubernetes", "-n", settings.namespace]) == 0
        swept |= f"ktlite: {name}: torn down (idle " in capsys.readouterr().err
        time.sleep(2)  # polling the cluster, bounded by the deadline
    print(f"{name}: torn down by {'the next ktlite list' if swept else 'its own pod 0'}")
