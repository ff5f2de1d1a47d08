"""The launch message a deployment sends its pods (``POST /deploy``), built in one place.

A plain deployment sends every pod the same launch with its own ordinal (and, for an
engine, its own engine settings); a served one writes one replica launch that every
replica loads. Both come from :func:`build_launch`.
"""

from __future__ import annotations

from typing import Any

from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.launch import Launch


def build_launch(
    spec: DeploymentSpec,
    *,
    launch_id: str,
    code: tuple[bytes, dict[str, Any], bytes | None],
    pod_ips: list[str],
    master_port: int,
    restart: bool,
    single: bool,
    replica: bool = False,
    store: dict[str, Any] | None = None,
) -> Launch:
    """The launch of ``spec``'s code (``code``: the pickled callable, its local modules'
    sources, its pickled constructor arguments) for pod 0; ``dataclasses.replace`` makes
    the other pods' from it (their ordinal, their engine settings)."""
    bundle, sources, init = code
    return Launch(
        launch_id=launch_id,
        bundle=bundle,
        kind=spec.kind,
        init=init,
        sources=sources,
        distributed=spec.distributed,
        pod_ips=pod_ips,
        master_port=master_port,
        max_restarts=spec.pod.calls.max_restarts,
        cpus=spec.pod.resources.cpus,
        restart=restart,
        concurrency=spec.concurrency,
        load_timeout=spec.pod.calls.launch_timeout,
        single=single,
        replica=replica,
        store=store,
    )
