"""What a pod serves: the launch it installed (:class:`Deployment`) and the targets
colocated with it (:class:`Colocated`); plain data, the user's code stays bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.launch import Sources

_PER_LAUNCH = ("KTLITE_LAUNCH_ID", "TORCHELASTIC_RUN_ID")


def layout_of(env: dict[str, str]) -> dict[str, str]:
    """The part of a rank env that, when changed, needs a fresh process (not per-launch ids)."""
    return {k: v for k, v in env.items() if k not in _PER_LAUNCH}


@dataclass
class Deployment:
    """What ``POST /deploy`` installs on a pod (all plain data; the code stays pickled bytes)."""

    launch_id: str
    bundle: bytes
    kind: str
    init: bytes | None
    sources: Sources
    config: DistributedLayout
    pod_ips: list[str]
    ordinal: int
    master_port: int
    max_restarts: int = 3
    cpus: float | None = None
    load_timeout: float = 300.0
    concurrency: int = 1  # calls each rank process runs at once
    engine: dict[str, Any] | None = (
        None  # distribute("ray"/"monarch"): this pod's engine (ktlite.modes.engines)
    )
    single: bool = False  # not distributed: a call returns one value, not a list by rank


@dataclass
class Colocated:
    """A second function/class loaded into the same rank processes (``kt.cls(B).to(remote_a)``)."""

    bundle: bytes
    kind: str
    init: bytes | None
    sources: Sources
