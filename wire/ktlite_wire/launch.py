"""What ``POST /deploy`` carries: a :class:`Launch` (the code a pod's ranks run, and their
layout) or a :class:`Colocation` (a second target loaded into the same rank processes).

The header is JSON; the user's code (the cloudpickled callable, its constructor arguments)
rides in buffers, opaque bytes until a rank process loads them. A replica's launch file
(``KTLITE_LAUNCH_FILE``, gzipped in a Kubernetes Secret) is the same message.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ktlite_wire import envelope
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.errors import ProtocolError

# a module shipped by source: (file name, source text, is a package)
Sources = dict[str, tuple[str, str, bool]]
KINDS = ("fn", "cls")


@dataclass(frozen=True)
class Launch:
    """The code and layout one pod installs. Built once per deployment by the client
    (``ktlite.modes.launch.build_launch``), then made each pod's with ``dataclasses.replace``
    (its ``ordinal``, its engine settings)."""

    launch_id: str
    bundle: bytes = field(repr=False)
    kind: str
    distributed: DistributedLayout
    pod_ips: list[str]
    master_port: int
    ordinal: int = 0
    init: bytes | None = field(default=None, repr=False)
    sources: Sources = field(default_factory=dict, repr=False)
    max_restarts: int = 3
    cpus: float | None = None
    load_timeout: float = 300.0
    concurrency: int = 1  # calls each rank process runs at once
    single: bool = False  # not distributed: a call returns one value, not a list by rank
    restart: bool = False  # fresh rank processes, even where the layout is unchanged
    replica: bool = False  # an autoscaled replica: rank 0 of a world of its own
    # distribute("ray"/"monarch"): this pod's engine settings (they hold the token)
    engine: dict[str, Any] | None = field(default=None, repr=False)
    # where the data store is, for kt.put/get in the ranks (holds the store's token)
    store: dict[str, Any] | None = field(default=None, repr=False)
    # a served deployment's launches are ordered: each .to() of the service takes the next
    # generation from where the launch is kept (``Serving.write_launch``), and a pod refuses
    # a launch older than the one it holds (ErrorCode.STALE_LAUNCH). 0: not ordered
    generation: int = 0

    def encode(self) -> bytes:
        header = {
            "type": "launch",
            "launch_id": self.launch_id,
            "kind": self.kind,
            "distributed": asdict(self.distributed),
            "pod_ips": self.pod_ips,
            "master_port": self.master_port,
            "ordinal": self.ordinal,
            "sources": sources_to_json(self.sources),
            "max_restarts": self.max_restarts,
            "cpus": self.cpus,
            "load_timeout": self.load_timeout,
            "concurrency": self.concurrency,
            "single": self.single,
            "restart": self.restart,
            "replica": self.replica,
            "engine": self.engine,
            "store": self.store,
            "generation": self.generation,
            "bundle": 0,
            "init": None if self.init is None else 1,
        }
        return envelope.encode_bytes(
            header, [self.bundle] + ([] if self.init is None else [self.init])
        )

    @classmethod
    def from_header(cls, h: dict[str, Any], bufs: list[memoryview]) -> Launch:
        try:
            bundle = envelope.buffer(bufs, h.get("bundle"), "the launch's bundle")
            if bundle is None:
                raise ValueError("it has no code bundle")
            init = envelope.buffer(bufs, h.get("init"), "the launch's init arguments")
            kind = h["kind"]
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
            pod_ips = h["pod_ips"]
            # map(type, ...) in C: the list has an address per pod, on every pod of a push
            if type(pod_ips) is not list or not set(map(type, pod_ips)) <= {str}:
                raise ValueError("pod_ips must be a list of addresses")
            cpus = h.get("cpus")
            engine, store = h.get("engine"), h.get("store")
            if engine is not None and not isinstance(engine, dict):
                raise ValueError("engine must be an object")
            if store is not None and not isinstance(store, dict):
                raise ValueError("store must be an object")
            generation = _int(h, "generation", 0)
            if generation < 0:
                raise ValueError(f"generation={generation} must be 0 or more")
            return cls(
                launch_id=_text(h, "launch_id"),
                bundle=bytes(bundle),
                kind=kind,
                distributed=DistributedLayout.from_json(h["distributed"]),
                pod_ips=list(pod_ips),
                master_port=_int(h, "master_port"),
                ordinal=_int(h, "ordinal", 0),
                init=None if init is None else bytes(init),
                sources=sources_from_json(h.get("sources")),
                max_restarts=_int(h, "max_restarts", 3),
                cpus=None if cpus is None else _seconds(cpus, "cpus"),
                load_timeout=_seconds(h.get("load_timeout", 300.0), "load_timeout"),
                concurrency=max(1, _int(h, "concurrency", 1)),
                single=bool(h.get("single", False)),
                restart=bool(h.get("restart", False)),
                replica=bool(h.get("replica", False)),
                engine=engine,
                store=store,
                generation=generation,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"a malformed launch: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Colocation:
    """Add or replace (or with ``drop``, remove) a named target in the rank processes of the
    launch a pod serves (``kt.cls(B).to(remote_a)``)."""

    target: str
    launch_id: str
    kind: str = "cls"
    bundle: bytes | None = field(default=None, repr=False)
    init: bytes | None = field(default=None, repr=False)
    sources: Sources = field(default_factory=dict, repr=False)
    drop: bool = False
    if_missing: bool = False  # only where a rank lacks it (re-pushed after a redeploy)

    def encode(self) -> bytes:
        bufs = [b for b in (self.bundle, self.init) if b is not None]
        header = {
            "type": "colocate",
            "target": self.target,
            "launch_id": self.launch_id,
            "kind": self.kind,
            "sources": sources_to_json(self.sources),
            "drop": self.drop,
            "if_missing": self.if_missing,
            "bundle": None if self.bundle is None else 0,
            "init": None if self.init is None else len(bufs) - 1,
        }
        return envelope.encode_bytes(header, bufs)

    @classmethod
    def from_header(cls, h: dict[str, Any], bufs: list[memoryview]) -> Colocation:
        try:
            bundle = envelope.buffer(bufs, h.get("bundle"), "the colocation's bundle")
            init = envelope.buffer(bufs, h.get("init"), "the colocation's init arguments")
            drop = bool(h.get("drop", False))
            if bundle is None and not drop:
                raise ValueError("it has no code bundle")
            kind = h.get("kind", "cls")
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
            return cls(
                target=_text(h, "target"),
                launch_id=str(h.get("launch_id") or ""),
                kind=kind,
                bundle=None if bundle is None else bytes(bundle),
                init=None if init is None else bytes(init),
                sources=sources_from_json(h.get("sources")),
                drop=drop,
                if_missing=bool(h.get("if_missing", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"a malformed colocation: {type(e).__name__}: {e}") from None


def decode_deploy(data: Any) -> Launch | Colocation:
    """Decode a ``POST /deploy`` body (or a launch file). Raises ProtocolError."""
    header, bufs = envelope.decode(data, "deploy message")
    kind = header.get("type")
    if kind == "launch":
        return Launch.from_header(header, bufs)
    if kind == "colocate":
        return Colocation.from_header(header, bufs)
    raise ProtocolError(f"a deploy message of type {kind!r}; expected 'launch' or 'colocate'")


def sources_to_json(sources: Sources) -> dict[str, list[Any]]:
    return {
        name: [filename, text, bool(is_pkg)] for name, (filename, text, is_pkg) in sources.items()
    }


def sources_from_json(data: Any) -> Sources:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("sources must be an object")
    out: Sources = {}
    for name, entry in data.items():
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
        ):
            raise ValueError(f"source of module {name!r} must be [file name, text, is package]")
        out[str(name)] = (entry[0], entry[1], bool(entry[2]))
    return out


def _text(h: dict[str, Any], key: str) -> str:
    value = h.get(key)
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(f"{key} must be a non-empty string of at most 200 characters")
    return value


def _int(h: dict[str, Any], key: str, default: int | None = None) -> int:
    value = h.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} must be a whole number")
    return value


def _seconds(value: Any, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{key}={value!r} must be a non-negative number")
    return float(value)
