"""A running deployment found by name, with its pods' status: what ``ktlite status`` (and
``call``, ``logs --rank``) and ``ktlite dashboard`` attach with. There is no Compute here: the
pods tell their layout."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

from ktlite.errors import KtliteError, NotDeployedError

if TYPE_CHECKING:  # the call path loads when a deployment is attached: `ktlite --help` needs none
    from ktlite.backends.base import Backend
    from ktlite.modes.deploy import Deployment


def attach(backend: Backend, name: str) -> tuple[Deployment, list[dict[str, Any]]]:
    """The running deployment ``name`` on ``backend`` (as a Deployment) and its pods' status;
    NotDeployedError when it does not run there."""
    from ktlite.api.compute import Compute
    from ktlite.modes.deploy import Deployment
    from ktlite.net.client import PodClient
    from ktlite.specs.deployment_spec import DeploymentSpec

    applied = backend.lookup(name)
    if applied is None:
        raise NotDeployedError(
            f"no deployment {name!r} on backend {backend.name!r}; `ktlite list` shows what runs"
        )
    if applied.autoscale is not None:  # replicas, each a world of one (and maybe none now)
        from ktlite.specs.autoscaling import AutoscaleConfig

        served = Compute(backend=backend.name, autoscaling=AutoscaleConfig(**applied.autoscale))
        dep = Deployment(DeploymentSpec(name, served.pod_spec()), backend, applied)
        return dep, pods_status(dep, None)
    # the layout (ranks per pod) is the pods' to tell
    status = PodClient(applied.token, http=applied.http).status(applied.endpoints[0].url)
    procs = max(1, len(status["ranks"]))
    compute = Compute(backend=backend.name).distribute(
        "spmd", workers=len(applied.endpoints), num_proc=procs
    )
    dep = Deployment(DeploymentSpec(name, compute.pod_spec()), backend, applied)
    if len(dep.endpoints) == 1:
        return dep, [status]
    return dep, pods_status(dep, None)


def pods_status(dep: Deployment, stuck_after: float | None) -> list[dict[str, Any]]:
    """Each pod's status: asked of pod 0, which gathers the others' (``modes.podtable``), else
    of each pod at once; a pod that does not answer is an entry saying so (``error``), so the
    others still show."""
    from ktlite.modes import podtable

    eps = dep.endpoints
    if not eps:
        return []
    header = dep.mode.table_relay(podtable.STATUS_S)
    if header is not None:
        try:
            table: list[dict[str, Any]] = dep.client.status(
                eps[0].url, stuck_after, relay=header, timeout=podtable.STATUS_S + podtable.SLACK_S
            )
            return table
        except KtliteError:
            pass  # pod 0 did not answer: ask each pod, so the others still show

    def one(ep: Any) -> dict[str, Any]:
        try:
            return dict(dep.client.status(ep.url, stuck_after))
        except KtliteError as e:
            return {"pod": ep.name, "ordinal": ep.ordinal, "error": str(e), "ranks": []}

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(eps))) as pool:
        return list(pool.map(one, eps))
