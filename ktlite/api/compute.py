"""``kt.Compute``: what one pod looks like, validated at construction.

A Compute holds a pod's resources and image itself, and its other settings in parts of
their own: ``kubernetes`` (:class:`~ktlite.specs.kube_options.KubernetesOptions`), ``calls``
(:class:`~ktlite.specs.call_defaults.CallDefaults`) and ``serving``
(:class:`~ktlite.specs.serving_options.ServingOptions`). Its constructor takes every keyword flat,
as users write them (Kubetorch's spellings through :mod:`ktlite.api.kubetorch_compute`), and
reading ``compute.namespace`` still works. :meth:`Compute.pod_spec` parses it once into the
:class:`~ktlite.specs.podspec.PodSpec` a backend reads.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ktlite.api import compute_checks as checks
from ktlite.api import distribution
from ktlite.api.compute_checks import WORKER_NODE_FIELDS
from ktlite.api.kubetorch_compute import ALIASES, EXTRA, KubetorchOperations, adapt
from ktlite.backends.registry import NAMES, traits
from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig, from_kwargs
from ktlite.specs.call_defaults import CALL_FIELDS, SERIALIZATIONS, CallDefaults
from ktlite.specs.hosts import Hosts, as_hosts
from ktlite.specs.images import Image
from ktlite.specs.kube_options import KUBERNETES_FIELDS, PULL_POLICIES, KubernetesOptions
from ktlite.specs.podspec import PodSpec, Resources
from ktlite.specs.quantities import memory_quantity, parse_cpus, parse_duration, parse_memory
from ktlite.specs.secrets import Secret, normalize
from ktlite.specs.serving_options import SERVING_FIELDS, ServingOptions
from ktlite.specs.spec import DistributedConfig
from ktlite.specs.volume import Volume

__all__ = [
    "BACKENDS",
    "PULL_POLICIES",
    "SERIALIZATIONS",
    "WORKER_NODE_FIELDS",
    "Compute",
    "Volume",
    "parse_cpus",
    "parse_duration",
    "parse_memory",
]

BACKENDS = NAMES
_MEMORY_FIELDS = ("memory", "memory_limit", "shared_memory", "disk_size", "gpu_memory")
_RESOURCE_FIELDS = ("cpus", "gpus", "cpu_limit", "gpu_type", *_MEMORY_FIELDS)  # Resources.parse's
# the parts a flat keyword goes to, and its keywords
_PARTS: dict[str, tuple[type, tuple[str, ...]]] = {
    "kubernetes": (KubernetesOptions, KUBERNETES_FIELDS),
    "calls": (CallDefaults, CALL_FIELDS),
    "serving": (ServingOptions, SERVING_FIELDS),
}
_PART_OF = {name: part for part, (_, names) in _PARTS.items() for name in names}
_POSITIONAL = (
    "cpus",
    "memory",
    "gpus",
    "cpu_limit",
    "memory_limit",
    "gpu_type",
    "image",
    "env",
    "volumes",
)


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


@dataclass(frozen=True, init=False)
class Compute(KubetorchOperations):
    """The resources and settings of one pod; ``.distribute()`` makes it N pods.

    Args:
        cpus: CPU request per pod (2, 0.5, "500m").
        memory: memory request per pod ("4Gi").
        gpus: GPUs per pod (``nvidia.com/gpu`` on Kubernetes); ``gpu_type`` picks the model.
            With pods of different sizes (``num_proc=[4, 8, 2]``) each pod gets one GPU per
            rank, or ``gpus`` where that is more (``gpus=1``: 4, 8 and 2 GPUs).
        cpu_limit, memory_limit: Kubernetes limits; none unless given.
        image: a :class:`kt.Image` or an image name.
        env: environment variables for every rank (``env_vars=`` is accepted too).
        volumes: :class:`kt.Volume` objects or names of existing PVCs.
        secrets: provider presets ("aws", "huggingface", ...), names of existing Kubernetes
            Secrets, or :func:`kt.secret` objects; see docs/secrets.md.
        backend: "local", "kubernetes" or "ssh"; default from KTLITE_BACKEND, else "local"
            ("ssh" when ``hosts`` is given).
        hosts: the machines of the "ssh" backend, one pod each: SSH destinations
            (``"gpu1"``, ``"user@10.0.0.2:2222"``), :class:`kt.Host` objects (with their own
            ``num_proc``) or a :class:`kt.Hosts` with connection options. The deployment has
            one worker per host.
        launch_timeout: seconds to wait for pods to become ready.
        call_timeout: default limit of each call in seconds (None: no limit; a hung call can
            always be interrupted with Ctrl-C); ``remote.options(timeout=...)`` overrides it.
        teardown_timeout: seconds ``teardown()`` waits for pods to stop before killing them.
        stream_logs: stream every rank's stdout/stderr to the caller during calls.
        max_restarts: how often a dead rank process is restarted between calls.
        concurrency: calls each rank process runs at once (sync ones on a pool of that many
            threads, ``async def`` ones on the rank's own event loop). Default: 8 for a
            single-rank ``kt.cls`` (serving), else 1; distributed deployments run their calls
            one at a time in arrival order unless this is set (collectives must run in the
            same order on every rank).
        tls: encrypt every request to the pods and between them with TLS pinned to a
            certificate made for this deployment (docs/tls.md). None (the default): on for
            the ssh and kubernetes backends, off for the local one (loopback only).

    Example:
        >>> compute = kt.Compute(cpus=2, memory="4Gi").distribute("pytorch", workers=2, num_proc=2)
    """

    cpus: float | str | None = None
    memory: str | None = None
    gpus: int = 0
    cpu_limit: float | str | None = None
    memory_limit: str | None = None
    gpu_type: str | None = None
    image: Image | None = None
    env: dict[str, str] = field(default_factory=dict)
    volumes: tuple[Volume | str, ...] = ()
    backend: str | None = None
    secrets: tuple[Secret, ...] = ()  # presets, existing Secrets' names, kt.secret(...)
    shared_memory: str | None = None
    disk_size: str | None = None  # ephemeral-storage request
    gpu_memory: str | None = None  # an annotation, as in Kubetorch: a whole GPU is requested
    freeze: bool = False  # the image already holds everything: no install at pod start
    working_dir: str | None = None  # the rank processes' working directory on a pod
    tls: bool | None = None  # None: the backend's default (Backend.tls_default)
    hosts: Hosts | None = None
    distributed: DistributedConfig | None = None
    # distribute("ray", worker_node_options=...): the worker pods' own sizes (the head: this)
    worker_node_options: dict[str, Any] | None = None
    kubernetes: KubernetesOptions = field(default_factory=KubernetesOptions)
    calls: CallDefaults = field(default_factory=CallDefaults)
    serving: ServingOptions = field(default_factory=ServingOptions)
    resources: Resources = field(init=False, repr=False, compare=False)  # the parsed sizes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(_POSITIONAL):
            raise ConfigError(
                f"Compute() takes at most {len(_POSITIONAL)} positional arguments "
                f"({', '.join(_POSITIONAL)}); pass the others by name"
            )
        for name, value in zip(_POSITIONAL, args, strict=False):
            if name in kwargs:
                raise ConfigError(f"Compute() got {name}= twice (by position and by name)")
            kwargs[name] = value
        kwargs = adapt(kwargs)
        for part, (kind, names) in _PARTS.items():
            base = kwargs.pop(part, None) or kind()
            if not isinstance(base, kind):
                raise ConfigError(f"{part}={base!r} must be a {kind.__name__}")
            defaults = {f.name: f for f in fields(kind)}
            own = {
                name: _default(defaults[name]) if kwargs[name] is None else kwargs[name]
                for name in names
                if name in kwargs
            }
            for name in own:
                del kwargs[name]
            object.__setattr__(self, part, replace(base, **own) if own else base)  # type: ignore[type-var]
        for f in fields(self):
            if f.init and f.name not in _PARTS:
                value = kwargs.pop(f.name, None)
                object.__setattr__(self, f.name, _default(f) if value is None else value)
        if kwargs:
            known = {f.name for f in fields(Compute) if f.init} | set(_PART_OF)
            raise checks.unknown_keywords(kwargs, known | set(ALIASES) | set(EXTRA))
        self._validate()

    def _with(self, **changes: Any) -> Compute:
        """A copy with ``changes``, which may name any keyword the constructor takes."""
        return replace(self, **changes)

    def __getattr__(self, name: str) -> Any:
        """The flat names of the parts' settings (``compute.namespace``, ``compute.launch_timeout``)."""
        if name in ALIASES or name in EXTRA:
            return None  # Kubetorch's names are read into ktlite's at construction, never stored
        part = _PART_OF.get(name) or ("calls" if name == "inactivity_seconds" else None)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def _validate(self) -> None:
        hosts, backend, distributed = checks.resolve_hosts(
            self.hosts, self.backend, self.distributed, self.gpus
        )
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "distributed", distributed)
        for name in _MEMORY_FIELDS:
            if getattr(self, name) is not None:  # "8GB" as NeMo and Ray users write it: "8G"
                object.__setattr__(self, name, memory_quantity(getattr(self, name), name))
        object.__setattr__(
            self,
            "resources",
            Resources.parse(**{name: getattr(self, name) for name in _RESOURCE_FIELDS}),
        )
        checks.check_pod_settings(self.backend, self.freeze, self.working_dir)
        checks.check_tls(self.tls)
        checks.check_env(self.env)
        if isinstance(self.image, str):
            object.__setattr__(self, "image", Image(self.image))
        if self.image is not None and not isinstance(self.image, Image):
            raise ConfigError(f"image={self.image!r} must be a kt.Image or an image name string")
        object.__setattr__(self, "secrets", normalize(self.secrets))
        volumes = checks.check_volumes(self.volumes, self.kubernetes.namespace)
        object.__setattr__(self, "volumes", volumes)
        if self.worker_node_options is not None:
            checks.check_worker_node_options(self.worker_node_options, self.distributed)
            self.pod_compute(1)  # bad option names or values fail here
        checks.check_layout(self.distributed, self.gpus, self.serving)

    def pod_spec(self) -> PodSpec:
        """This Compute parsed into the :class:`~ktlite.specs.podspec.PodSpec` a backend reads."""
        worker = self.pod_compute(1).pod_spec() if self.worker_node_options else None
        return PodSpec(
            resources=self.resources,
            image=self.image,
            env=dict(self.env),
            volumes=self.volumes,
            secrets=self.secrets,
            working_dir=self.working_dir,
            freeze=self.freeze,
            tls=self.tls,
            backend=self.backend,
            kubernetes=self.kubernetes,
            hosts=self.hosts,
            calls=self.calls,
            distributed=self.distributed,
            autoscaling=self.serving.autoscaling,
            worker=worker,
        )

    def served(self) -> Compute:
        """What ``.to()`` deploys: ``Compute(replicas=N)`` without ``distribute()`` is Kubetorch's
        N load-balanced replicas, i.e. ``autoscale(min_scale=N, max_scale=N)`` (a
        ``.distribute()`` may still come, so this is decided at ``.to()``)."""
        if self.replicas is not None and self.distributed is None and self.autoscaling is None:
            if self.hosts is not None or not traits(self.backend).serves:
                raise ConfigError(
                    f"Compute(replicas={self.replicas}) asks for load-balanced replicas, which the "
                    "ssh backend does not run; use .distribute('spmd', workers=N)"
                )
            return self._with(
                replicas=None,
                autoscaling=AutoscaleConfig(
                    min_scale=self.replicas, max_scale=self.replicas, initial_scale=self.replicas
                ),
            )
        return self

    def autoscale(self, **kwargs: Any) -> Compute:
        """Serve this Compute's function or class from replicas that grow and shrink with load
        (Kubetorch's ``.autoscale``); changes this Compute and returns it. Each call goes to
        one replica and returns one value. The options and their defaults are in
        :mod:`ktlite.specs.autoscaling` (``min_scale``, ``max_scale``, ``concurrency``, ``target``,
        ``metric``, ``window``, ``scale_down_delay``, ...)."""
        if self.hosts is not None:
            raise ConfigError(
                "autoscale() with hosts= (backend='ssh'): the ssh backend runs a fixed set of "
                "hosts; autoscaled serving runs on the local and kubernetes backends"
            )
        if self.distributed is not None:
            raise ConfigError(
                "a Compute cannot use both .distribute() and .autoscale(): distribute() runs "
                "every call on every rank of N pods, autoscale() one call on one of N "
                "interchangeable replicas; pick one"
            )
        if self.replicas is not None:
            raise ConfigError(
                f"Compute(replicas={self.replicas}) with .autoscale(): the autoscaler sets the "
                "replicas; use autoscale(initial_scale=..., min_scale=..., max_scale=...)"
            )
        object.__setattr__(self, "serving", replace(self.serving, autoscaling=from_kwargs(kwargs)))
        return self

    def pod_compute(self, ordinal: int) -> Compute:
        """What pod ``ordinal`` looks like: this Compute, or for a Ray worker node (ordinal
        1..N) this one with ``worker_node_options`` applied."""
        options = self.worker_node_options
        if not options or ordinal == 0:
            return self
        checks.check_worker_node_fields(options)
        return self._with(**options, distributed=None, worker_node_options=None)

    def pod_gpus(self, ordinal: int) -> int:
        """GPUs pod ``ordinal`` requests: ``gpus`` (a Ray worker node's own), and on a GPU
        deployment whose pods differ in size, at least one per rank of that pod."""
        d = self.distributed
        gpus = self.pod_compute(ordinal).gpus
        if not gpus or d is None or d.uniform:
            return gpus
        return max(gpus, d.procs(ordinal))

    @property
    def cpu_count(self) -> float | None:
        """``cpus`` as a number (None: no request)."""
        return self.resources.cpus

    def distribute(
        self,
        framework: str | None = None,
        workers: int | None = None,
        num_proc: int | list[int] | tuple[int, ...] | str | None = None,
        port: int | None = None,
        quorum_timeout: float | None = None,
        worker_node_options: dict[str, Any] | None = None,
        *,
        distribution_type: str | None = None,
        quorum_workers: int | None = None,
        monitor_members: bool | None = None,
        max_threads_per_proc: int | None = None,
        restart_procs: bool | None = None,
        tree_fanout: int | None = None,
        tree_minimum: int | None = None,
        **unknown: Any,
    ) -> Compute:
        """Make this Compute run on ``workers`` pods × ``num_proc`` ranks each; returns it.

        As in Kubetorch, the Compute it is called on changes (``compute.distribute(...)``
        alone is enough), and it is returned for chaining. Kubetorch's keywords are taken:
        ``distribution_type`` (``framework``), ``num_proc="auto"``, ``quorum_workers`` (must be
        ``workers``: a call runs on every pod), ``monitor_members`` (ktlite always watches: a
        lost pod fails the call with :class:`kt.WorkerMembershipChanged`),
        ``max_threads_per_proc`` (``Compute.concurrency``), ``restart_procs``, and
        ``tree_fanout``/``tree_minimum``: from ``tree_minimum`` pods on (default 64), pod 0
        sends a call, a code push and a cancel to at most ``tree_fanout`` pods (default 32),
        each of which relays it to its share of the rest (see :class:`DistributedConfig`).
        """
        framework = distribution.framework_of(framework, distribution_type)
        if num_proc == "auto":
            num_proc = None
        distribution.check_kubetorch_options(monitor_members, tree_fanout, tree_minimum)
        changes: dict[str, Any] = {}
        if max_threads_per_proc is not None:
            changes["concurrency"] = max_threads_per_proc
        if restart_procs is not None:
            changes["restart_procs"] = restart_procs
        new = self._with(**changes)._distributed(
            framework,
            workers,
            num_proc,
            port,
            300.0 if quorum_timeout is None else quorum_timeout,
            worker_node_options,
            **unknown,
        )
        if new.distributed is not None and (tree_fanout, tree_minimum) != (None, None):
            tree = replace(new.distributed, tree_fanout=tree_fanout, tree_minimum=tree_minimum)
            new = new._with(distributed=tree)
        distribution.check_quorum_workers(
            quorum_workers, new.distributed.workers if new.distributed is not None else 1
        )
        for f in fields(self):
            object.__setattr__(self, f.name, getattr(new, f.name))
        return self

    def _distributed(
        self,
        framework: str = "spmd",
        workers: int | None = None,
        num_proc: int | list[int] | tuple[int, ...] | str | None = None,
        port: int | None = None,
        quorum_timeout: float = 300.0,
        worker_node_options: dict[str, Any] | None = None,
        **unknown: Any,
    ) -> Compute:
        """A copy of this Compute that runs on ``workers`` pods × ``num_proc`` ranks each
        (a Ray cluster: a head and ``workers`` worker nodes); see
        :func:`ktlite.api.distribution.layout`."""
        config, node_options = distribution.layout(
            framework,
            workers,
            num_proc,
            port,
            quorum_timeout,
            worker_node_options,
            gpus=self.gpus,
            hosts=as_hosts(self.hosts),
            autoscaled=self.autoscaling is not None,
            unknown=unknown,
        )
        ray = config.framework == "ray"
        return self._with(
            distributed=config,
            worker_node_options=node_options,
            replicas=None if ray or self.replicas is None else config.workers,
        )


def _signature() -> inspect.Signature:
    """``Compute(...)``'s keywords for help() and editors: its own fields, then its parts'."""
    own = [f for f in fields(Compute) if f.init and f.name not in _PARTS]
    kinds = {name: inspect.Parameter.POSITIONAL_OR_KEYWORD for name in _POSITIONAL}
    params = [
        inspect.Parameter(
            f.name, kinds.get(f.name, inspect.Parameter.KEYWORD_ONLY), default=_default(f)
        )
        for f in sorted(own, key=lambda f: f.name not in kinds)
    ]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f))
        for kind, _ in _PARTS.values()
        for f in fields(kind)
    ]
    return inspect.Signature(params)


Compute.__signature__ = _signature()  # type: ignore[attr-defined]
