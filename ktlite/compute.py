"""``kt.Compute`` and ``kt.Volume``: what one pod looks like, validated at construction."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from ktlite.errors import ConfigError
from ktlite.hosts import Hosts, as_hosts
from ktlite.images import Image
from ktlite.quantities import memory_quantity, parse_cpus, parse_duration, parse_memory
from ktlite.secrets import Secret, normalize
from ktlite.spec import DistributedConfig

BACKENDS = ("local", "kubernetes", "ssh")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # what Kubernetes accepts (and POSIX shells)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_RESERVED_MOUNTS = ("/ktlite", "/dev/shm")  # ktlite's state dir and shared memory on a pod
_RESERVED_ENV = (
    "KTLITE_TOKEN", "KTLITE_POD_NAME", "KTLITE_POD_IP", "KTLITE_POD_ORDINAL", "KTLITE_NAMESPACE",
    "KTLITE_DEPLOYMENT", "KTLITE_BACKEND", "KTLITE_PORT", "KTLITE_PROCS", "KTLITE_INSTALL",
    "KTLITE_FREEZE", "KTLITE_SETUP", "KTLITE_IMAGE",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "POD_IPS", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
# what distribute("ray", worker_node_options={...}) may size differently on the worker pods
WORKER_NODE_FIELDS = ("cpus", "memory", "gpus", "cpu_limit", "memory_limit", "gpu_type",
                      "shared_memory", "node_selector", "tolerations", "labels", "annotations",
                      "priority_class")


SERIALIZATIONS = ("json", "pickle")  # Kubetorch's call serialization formats ktlite takes


@dataclass(frozen=True)
class Volume:
    """A persistent volume mounted into every pod: a PVC on Kubernetes; locally the directory
    ``$KTLITE_HOME/volumes/<name>`` (see docs/local_backend.md).

    Args:
        name: the volume (and PVC) name.
        size: capacity such as "10Gi".
        mount_path: where it appears in the pod.
        access_mode: "ReadWriteMany" (shared across pods) or "ReadWriteOnce".
        storage_class: the Kubernetes StorageClass; None uses the cluster default.
    """

    name: str
    size: str = "10Gi"
    mount_path: str = ""
    access_mode: str = "ReadWriteMany"
    storage_class: str | None = None
    namespace: str | None = None  # Kubetorch's: must be the deployment's (pods mount their own namespace's PVCs)
    volume_name: str | None = None  # bind the claim to this PersistentVolume

    @classmethod
    def from_name(cls, name: str, mount_path: str | None = None, **kwargs: Any) -> Volume:
        """An existing PersistentVolumeClaim, mounted at ``mount_path`` (default ``/<name>``);
        the same as naming it in ``Compute(volumes=["name"])``."""
        return cls(name, mount_path=mount_path or "", **kwargs)

    def _refuse(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"Volume.{what}() is not supported: ktlite creates a kt.Volume's claim with the deployment that "
            "mounts it and deletes it with teardown(volumes=True) (`ktlite teardown NAME --volumes`); "
            "look at claims with `kubectl get pvc`")

    def create(self) -> Volume:
        raise self._refuse("create")

    def delete(self) -> None:
        raise self._refuse("delete")

    def exists(self) -> bool:
        raise self._refuse("exists")

    def ssh(self) -> None:
        raise self._refuse("ssh")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _DNS_LABEL.match(self.name):
            raise ConfigError(f"Volume(name={self.name!r}) is not a valid PVC name: use lowercase "
                              "letters, digits and '-', at most 63 characters, e.g. 'train-data'")
        object.__setattr__(self, "size", memory_quantity(self.size, "Volume.size"))
        if self.access_mode not in ("ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"):
            raise ConfigError(f"Volume.access_mode={self.access_mode!r}; allowed: ReadWriteMany, "
                              "ReadWriteOnce, ReadOnlyMany, ReadWriteOncePod")
        if not self.mount_path:
            object.__setattr__(self, "mount_path", f"/{self.name}")
        if not self.mount_path.startswith("/"):
            raise ConfigError(f"Volume.mount_path={self.mount_path!r} must be an absolute path like '/data'")


@dataclass(frozen=True)
class Compute:
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

    Example:
        >>> compute = kt.Compute(cpus=2, memory="4Gi").distribute("pytorch", workers=2, num_proc=2)
    """

    cpus: float | str | None = None
    memory: str | None = None
    gpus: int = 0
    cpu_limit: float | str | None = None
    memory_limit: str | None = None
    gpu_type: str | None = None
    image: Image | str | None = None
    env: dict[str, str] = field(default_factory=dict)
    volumes: tuple[Volume | str, ...] = ()
    backend: str | None = None
    namespace: str | None = None
    launch_timeout: float = 600.0
    call_timeout: float | None = None
    teardown_timeout: float = 30.0
    inactivity_ttl: str | None = None
    stream_logs: bool = True
    max_restarts: int = 3
    concurrency: int | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str | Secret, ...] = ()  # presets, existing Secrets' names, kt.secret(...)
    service_account: str | None = None
    image_pull_policy: str | None = None
    priority_class: str | None = None
    shared_memory: str | None = None
    distributed: DistributedConfig | None = None
    # distribute("ray", worker_node_options=...): the worker pods' own sizes (the head: this)
    worker_node_options: dict[str, Any] | None = None
    env_vars: dict[str, str] | None = None  # Kubetorch's name for env
    hosts: Hosts | None = None
    # Kubetorch's fields (README, "Coming from Kubetorch")
    disk_size: str | None = None  # ephemeral-storage request
    gpu_memory: str | None = None  # an annotation, as in Kubetorch: a whole GPU is requested
    freeze: bool = False  # the image already holds everything: no install at pod start
    kubeconfig_path: str | None = None
    gpu_anti_affinity: bool = False  # a CPU-only pod stays off nodes with GPUs
    working_dir: str | None = None  # the rank processes' working directory on a pod
    allowed_serialization: tuple[str, ...] | None = None
    queue_name: str | None = None  # Kueue LocalQueue
    service_template: dict[str, Any] | None = None  # merged deeply into each StatefulSet
    restart_procs: bool = False  # every .to() starts fresh rank processes
    replicas: int | None = None
    autoscaling: Any = None  # ktlite.autoscaling.AutoscaleConfig: set by .autoscale()
    logging_config: Any = None
    selector: Any = None
    endpoint: Any = None
    # Kubetorch's spellings of fields above
    priority_class_name: str | None = None
    service_account_name: str | None = None
    shared_memory_limit: str | None = None

    def __post_init__(self) -> None:
        self._kubetorch_fields()
        self._check_hosts()
        for name in ("memory", "memory_limit", "shared_memory", "disk_size", "gpu_memory"):
            if getattr(self, name) is not None:  # "8GB" as NeMo and Ray users write it: "8G"
                object.__setattr__(self, name, memory_quantity(getattr(self, name), name))
        self.inactivity_seconds  # noqa: B018 - a bad duration fails here, before any deploy
        if self.env_vars is not None:
            if self.env:
                raise ConfigError("pass env= or env_vars= (the Kubetorch name), not both")
            object.__setattr__(self, "env", dict(self.env_vars))
            object.__setattr__(self, "env_vars", None)
        if self.cpus is not None:
            parse_cpus(self.cpus)
        if self.cpu_limit is not None and parse_cpus(self.cpu_limit, "cpu_limit") < (self.cpu_count or 0):
            raise ConfigError(f"cpu_limit={self.cpu_limit!r} is below cpus={self.cpus!r}; a limit must be "
                              "at least the request")
        if self.memory_limit is not None and \
                parse_memory(self.memory_limit, "memory_limit") < parse_memory(self.memory or "0"):
            raise ConfigError(f"memory_limit={self.memory_limit!r} is below memory={self.memory!r}; a limit "
                              "must be at least the request")
        if self.image_pull_policy not in (None, *PULL_POLICIES):
            raise ConfigError(f"image_pull_policy={self.image_pull_policy!r}; allowed: "
                              f"{', '.join(PULL_POLICIES)}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ConfigError(f"gpus={self.gpus!r} must be a whole number >= 0")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; allowed: {', '.join(map(repr, BACKENDS))}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.env.items()):
            raise ConfigError(f"env={self.env!r} must map str to str; convert values with str()")
        bad = [k for k in self.env if not _ENV_NAME.match(k)]
        if bad:
            raise ConfigError(f"env names {bad!r} are not valid environment variable names: use "
                              "letters, digits and '_' (not starting with a digit), e.g. 'MY_VAR'")
        nul = [k for k, v in self.env.items() if "\0" in v]
        if nul:
            raise ConfigError(f"env values of {nul!r} contain a NUL character, which no environment can hold")
        clash = sorted(set(self.env) & set(_RESERVED_ENV))
        if clash:
            raise ConfigError(f"env sets {', '.join(clash)}, which ktlite sets per rank; remove "
                              "them (use distribute(port=...) for MASTER_PORT)")
        if isinstance(self.launch_timeout, bool) or not isinstance(self.launch_timeout, (int, float)) \
                or not math.isfinite(self.launch_timeout) or self.launch_timeout <= 0:
            raise ConfigError(f"launch_timeout={self.launch_timeout!r} must be a positive number of seconds")
        for field_name in ("call_timeout", "teardown_timeout"):
            value = getattr(self, field_name)
            if value is None and field_name == "call_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"{field_name}={value!r} must be a positive number of seconds (finite)"
                                  + (" (or None for no limit)" if field_name == "call_timeout" else ""))
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be a whole number >= 0")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or not isinstance(
                self.concurrency, int) or not 1 <= self.concurrency <= 1024):
            raise ConfigError(f"concurrency={self.concurrency!r} must be a whole number between 1 and 1024 "
                              "(calls each rank process runs at once)")
        if isinstance(self.image, str):
            object.__setattr__(self, "image", Image(self.image))
        if self.image is not None and not isinstance(self.image, Image):
            raise ConfigError(f"image={self.image!r} must be a kt.Image or an image name string")
        object.__setattr__(self, "volumes", tuple(self.volumes))
        object.__setattr__(self, "tolerations", tuple(self.tolerations))
        object.__setattr__(self, "secrets", normalize(self.secrets))
        mounts: dict[str, Any] = {}
        for v in self.volumes:
            if not isinstance(v, (Volume, str)):
                raise ConfigError(f"volumes entry {v!r} must be a kt.Volume or the name of an existing PVC")
            if isinstance(v, str) and not _DNS_LABEL.match(v):
                raise ConfigError(f"volumes entry {v!r} is not a valid PVC name (lowercase letters, "
                                  "digits and '-')")
            if isinstance(v, Volume) and v.namespace and self.namespace and v.namespace != self.namespace:
                raise ConfigError(f"Volume({v.name!r}, namespace={v.namespace!r}) is not in the deployment's "
                                  f"namespace {self.namespace!r}; pods mount claims of their own namespace")
            path = v.mount_path if isinstance(v, Volume) else f"/{v}"
            if path.rstrip("/") in _RESERVED_MOUNTS:
                raise ConfigError(f"volume {v!r} mounts at {path}, which ktlite uses on every pod; "
                                  "pass another mount_path")
            if path in mounts:
                raise ConfigError(f"volumes {mounts[path]!r} and {v!r} both mount at {path}; give "
                                  "each its own mount_path")
            mounts[path] = v
        d = self.distributed
        if self.worker_node_options is not None:
            if not isinstance(self.worker_node_options, dict):
                raise ConfigError(f"worker_node_options={self.worker_node_options!r} must be a dict of "
                                  "Compute fields, e.g. {'cpus': '4', 'memory': '16Gi', 'gpus': 1}")
            if d is None or d.framework != "ray":
                raise ConfigError("worker_node_options sizes the worker nodes of a Ray cluster; it needs "
                                  "distribute('ray', ...). For pods of different sizes otherwise, "
                                  "use num_proc=[...] (one entry per pod)")
            self.pod_compute(1)  # bad option names or values fail here
        if d is not None and d.uniform and self.gpus and d.max_procs > self.gpus:
            raise ConfigError(f"num_proc={d.num_proc} has a pod of {d.max_procs} ranks, more than gpus={self.gpus} "
                              f"on a GPU pod; each rank needs at least one GPU: use num_proc<={self.gpus}")

    def _kubetorch_fields(self) -> None:
        """Kubetorch's forms: None means "not set" for every field, GPU counts may be
        strings, and its field names are spellings of ktlite's."""
        for f in fields(self):
            if getattr(self, f.name) is None:
                default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
                if default is not None and default is not MISSING:
                    object.__setattr__(self, f.name, default)
        for alias, own in (("priority_class_name", "priority_class"),
                           ("service_account_name", "service_account"),
                           ("shared_memory_limit", "shared_memory")):
            value = getattr(self, alias)
            if value is None:
                continue
            if getattr(self, own) is not None and getattr(self, own) != value:
                raise ConfigError(f"pass {own}= or {alias}= (the Kubetorch name), not both")
            object.__setattr__(self, own, value)
            object.__setattr__(self, alias, None)
        if isinstance(self.gpus, str):
            text = self.gpus.strip()
            if not text.isdigit():
                raise ConfigError(f"gpus={self.gpus!r} must be a whole number of GPUs such as 1 or '1'; "
                                  "pick the model with gpu_type=, e.g. gpu_type='NVIDIA-A100-SXM4-80GB'")
            object.__setattr__(self, "gpus", int(text))
        for name in ("freeze", "gpu_anti_affinity", "restart_procs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.working_dir is not None and (not isinstance(self.working_dir, str)
                                             or not self.working_dir.startswith("/")):
            raise ConfigError(f"working_dir={self.working_dir!r} must be an absolute path in the pod, "
                              "e.g. '/workspace'")
        if self.allowed_serialization is not None:
            allowed = (self.allowed_serialization,) if isinstance(self.allowed_serialization, str) \
                else tuple(self.allowed_serialization)
            bad = [a for a in allowed if a not in SERIALIZATIONS]
            if bad or not allowed:
                raise ConfigError(f"allowed_serialization={self.allowed_serialization!r}; allowed entries: "
                                  f"{', '.join(map(repr, SERIALIZATIONS))}")
            object.__setattr__(self, "allowed_serialization", allowed)
        if self.queue_name is not None and (not isinstance(self.queue_name, str) or not _DNS_LABEL.match(
                self.queue_name)):
            raise ConfigError(f"queue_name={self.queue_name!r} must name a Kueue LocalQueue (a DNS label)")
        if self.service_template is not None and not isinstance(self.service_template, dict):
            raise ConfigError(f"service_template={self.service_template!r} must be a dict merged into the "
                              "generated StatefulSet, e.g. {'spec': {'template': {'spec': {...}}}}")
        if self.kubeconfig_path is not None and not isinstance(self.kubeconfig_path, str):
            raise ConfigError(f"kubeconfig_path={self.kubeconfig_path!r} must be a path string")
        if self.logging_config is not None:
            from ktlite.kubetorch import LoggingConfig

            if not isinstance(self.logging_config, LoggingConfig):
                raise ConfigError(f"logging_config={self.logging_config!r} must be a kt.LoggingConfig")
            if self.logging_config.stream_logs is not None:
                object.__setattr__(self, "stream_logs", bool(self.logging_config.stream_logs))
        if self.selector is not None or self.endpoint is not None:
            which = "selector" if self.selector is not None else "endpoint"
            raise NotImplementedError(
                f"Compute({which}=...) brings your own pods, which ktlite does not support: ktlite "
                "creates and owns its pods. Give the resources instead (Compute(cpus=, gpus=, image=, "
                "node_selector=...)), or run on existing machines with hosts=[...] (backend='ssh')")
        if self.autoscaling is not None:
            from ktlite.autoscaling import AutoscaleConfig

            if not isinstance(self.autoscaling, AutoscaleConfig):
                raise ConfigError(f"autoscaling={self.autoscaling!r}: use compute.autoscale(min_scale=..., ...)")
            if self.distributed is not None:
                raise ConfigError("a Compute cannot use both .distribute() and .autoscale(); pick one")
        if self.replicas is not None:
            if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
                raise ConfigError(f"replicas={self.replicas!r} must be a whole number >= 1")
            d = self.distributed
            if d is not None and self.replicas != d.workers:
                raise ConfigError(f"replicas={self.replicas} but distribute() asks for {d.workers} pods; "
                                  "leave replicas out (distribute's workers sets it)")

    def served(self) -> Compute:
        """What ``.to()`` deploys: ``Compute(replicas=N)`` without ``distribute()`` is Kubetorch's
        N load-balanced replicas, i.e. ``autoscale(min_scale=N, max_scale=N)`` (a
        ``.distribute()`` may still come, so this is decided at ``.to()``)."""
        if self.replicas is not None and self.distributed is None and self.autoscaling is None:
            from ktlite.autoscaling import AutoscaleConfig
            if self.hosts is not None or self.backend == "ssh":
                raise ConfigError(f"Compute(replicas={self.replicas}) asks for load-balanced replicas, which the "
                                  "ssh backend does not run; use .distribute('spmd', workers=N)")
            return replace(self, replicas=None, autoscaling=AutoscaleConfig(
                min_scale=self.replicas, max_scale=self.replicas, initial_scale=self.replicas))
        return self

    # Kubetorch's live operations on a Compute's pods: ktlite's Compute describes pods and is
    # not bound to a deployment, so each names what to use instead
    def _live(self, what: str, instead: str) -> NotImplementedError:
        return NotImplementedError(f"compute.{what} is not supported: a ktlite Compute describes pods and "
                                   f"is not bound to a deployment; {instead}")

    def pip_install(self, *args: Any, **kwargs: Any) -> None:
        raise self._live("pip_install()", "put the packages in the image, kt.Image(...).pip_install([...]), "
                         "and .to() again (installed at pod start, cached per pod)")

    def run_bash(self, *args: Any, **kwargs: Any) -> None:
        raise self._live("run_bash()", "run the command from a function on the pods, e.g. "
                         "kt.fn(setup).to(compute), or at pod start with kt.Image(...).run_bash(cmd)")

    def sync_package(self, *args: Any, **kwargs: Any) -> None:
        raise self._live("sync_package()", "ktlite ships the local packages your code imports with every .to()")

    def ssh(self, *args: Any, **kwargs: Any) -> None:
        raise self._live("ssh()", "`kubectl exec -it NAME-0 -- bash` opens a shell in pod 0")

    def pods(self) -> None:
        raise self._live("pods()", "remote.status() lists the deployment's pods and ranks")

    def is_up(self) -> None:
        raise self._live("is_up()", "remote.status() (or `ktlite status NAME`) answers it")

    def autoscale(self, **kwargs: Any) -> Compute:
        """Serve this Compute's function or class from replicas that grow and shrink with load
        (Kubetorch's ``.autoscale``); changes this Compute and returns it. Each call goes to
        one replica and returns one value. The options and their defaults are in
        :mod:`ktlite.autoscaling` (``min_scale``, ``max_scale``, ``concurrency``, ``target``,
        ``metric``, ``window``, ``scale_down_delay``, ...)."""
        from ktlite.autoscaling import from_kwargs

        if self.hosts is not None:
            raise ConfigError("autoscale() with hosts= (backend='ssh'): the ssh backend runs a fixed set of "
                              "hosts; autoscaled serving runs on the local and kubernetes backends")
        if self.distributed is not None:
            raise ConfigError("a Compute cannot use both .distribute() and .autoscale(): distribute() runs "
                              "every call on every rank of N pods, autoscale() one call on one of N "
                              "interchangeable replicas; pick one")
        if self.replicas is not None:
            raise ConfigError(f"Compute(replicas={self.replicas}) with .autoscale(): the autoscaler sets the "
                              "replicas; use autoscale(initial_scale=..., min_scale=..., max_scale=...)")
        object.__setattr__(self, "autoscaling", from_kwargs(kwargs))
        return self

    @classmethod
    def from_manifest(cls, *args: Any, **kwargs: Any) -> Compute:
        raise NotImplementedError("Compute.from_manifest() (bring your own manifest) is not supported by ktlite: "
                                  "ktlite builds its own manifests from kt.Compute's fields (service_template= "
                                  "merges extra fields into them; `ktlite deploy --dry-run` prints them)")

    @property
    def inactivity_seconds(self) -> float | None:
        """``inactivity_ttl`` in seconds (None: no limit)."""
        return parse_duration(self.inactivity_ttl, "inactivity_ttl")

    def _check_hosts(self) -> None:
        """``hosts`` means the ssh backend, one pod per host, each host's ranks its own."""
        hosts = as_hosts(self.hosts)
        if hosts is None and self.backend == "ssh":  # `ktlite config set ssh.hosts gpu1,gpu2`
            from ktlite import config

            listed = [h.strip() for h in (config.get("ssh.hosts") or "").split(",") if h.strip()]
            hosts = Hosts(tuple(listed)) if listed else None
        object.__setattr__(self, "hosts", hosts)
        if hosts is None:
            return
        if self.backend is None:
            object.__setattr__(self, "backend", "ssh")
        elif self.backend != "ssh":
            raise ConfigError(f"hosts= names the machines of backend='ssh', not backend={self.backend!r}; "
                              "leave backend out (or 'ssh') to run on those hosts")
        d = self.distributed
        if d is None:
            object.__setattr__(self, "distributed", DistributedConfig(
                workers=len(hosts), num_proc=[n or self.gpus or 1 for n in hosts.sizes]))
            return
        if d.workers != len(hosts):
            raise ConfigError(f"distribute(workers={d.workers}) but hosts= names {len(hosts)} host(s); one pod "
                              "runs per host: leave workers out, or list as many hosts")
        clash = [(h.address, h.num_proc, d.procs(i)) for i, h in enumerate(hosts.hosts)
                 if h.num_proc is not None and h.num_proc != d.procs(i)]
        if clash:
            address, own, given = clash[0]
            raise ConfigError(f"Host({address!r}, num_proc={own}) but distribute() gives it {given} rank(s); "
                              "leave num_proc out of distribute() to use each host's own")

    def pod_compute(self, ordinal: int) -> Compute:
        """What pod ``ordinal`` looks like: this Compute, or for a Ray worker node (ordinal
        1..N) this one with ``worker_node_options`` applied."""
        options = self.worker_node_options
        if not options or ordinal == 0:
            return self
        unknown = sorted(set(options) - set(WORKER_NODE_FIELDS))
        if unknown:
            raise ConfigError(f"worker_node_options has unknown or head-only field(s) {', '.join(map(repr, unknown))}; "
                              f"allowed: {', '.join(WORKER_NODE_FIELDS)} (image, env, volumes and the "
                              "rest are the head's for every node)")
        return replace(self, **options, distributed=None, worker_node_options=None)

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
        return None if self.cpus is None else parse_cpus(self.cpus)

    def distribute(self, framework: str | None = None, workers: int | None = None,
                   num_proc: int | list[int] | tuple[int, ...] | str | None = None,
                   port: int | None = None, quorum_timeout: float | None = None,
                   worker_node_options: dict[str, Any] | None = None, *,
                   distribution_type: str | None = None, quorum_workers: int | None = None,
                   monitor_members: bool | None = None, max_threads_per_proc: int | None = None,
                   restart_procs: bool | None = None, tree_fanout: int | None = None,
                   tree_minimum: int | None = None, **unknown: Any) -> Compute:
        """Make this Compute run on ``workers`` pods × ``num_proc`` ranks each; returns it.

        As in Kubetorch, the Compute it is called on changes (``compute.distribute(...)``
        alone is enough), and it is returned for chaining. Kubetorch's keywords are taken:
        ``distribution_type`` (``framework``), ``num_proc="auto"``, ``quorum_workers`` (must be
        ``workers``: a call runs on every pod), ``monitor_members`` (ktlite always watches: a
        lost pod fails the call with :class:`kt.WorkerMembershipChanged`),
        ``max_threads_per_proc`` (``Compute.concurrency``), ``restart_procs`` and
        ``tree_fanout``/``tree_minimum`` (ktlite's coordinator calls every pod itself).
        """
        if distribution_type is not None:
            if framework is not None and framework != distribution_type:
                raise ConfigError("pass framework= or distribution_type= (the Kubetorch name), not both")
            framework = distribution_type
        framework = "spmd" if framework is None else framework
        framework = "tensorflow" if framework == "tf" else framework
        if num_proc == "auto":
            num_proc = None
        if monitor_members is not None and not isinstance(monitor_members, bool):
            raise ConfigError(f"monitor_members={monitor_members!r} must be True or False")
        for key, value in (("tree_fanout", tree_fanout), ("tree_minimum", tree_minimum)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{key}={value!r} must be a whole number >= 1")
        changes: dict[str, Any] = {}
        if max_threads_per_proc is not None:
            changes["concurrency"] = max_threads_per_proc
        if restart_procs is not None:
            changes["restart_procs"] = restart_procs
        new = replace(self, **changes)._distributed(
            framework, workers, num_proc, port, 300.0 if quorum_timeout is None else quorum_timeout,
            worker_node_options, **unknown)
        pods = new.distributed.workers if new.distributed is not None else 1
        if quorum_workers is not None and quorum_workers != pods:
            raise ConfigError(f"quorum_workers={quorum_workers!r}: ktlite runs a call on every pod, so it "
                              f"waits for all {pods} (up to quorum_timeout) and fails naming the missing "
                              "ones; leave quorum_workers out, or lower workers")
        for f in fields(self):
            object.__setattr__(self, f.name, getattr(new, f.name))
        return self

    def _distributed(self, framework: str = "spmd", workers: int | None = None,
                     num_proc: int | list[int] | tuple[int, ...] | None = None,
                     port: int | None = None, quorum_timeout: float = 300.0,
                     worker_node_options: dict[str, Any] | None = None, **unknown: Any) -> Compute:
        """A copy of this Compute that runs on ``workers`` pods × ``num_proc`` ranks each.

        ``num_proc`` defaults to the pod's GPU count (one rank per GPU), else 1. A list gives
        each pod its own size (``num_proc=[4, 8, 2]``: 3 pods, 14 ranks); ``workers`` is then
        its length. ``workers`` defaults to 1 otherwise.

        ``framework="ray"``: a Ray cluster of one head pod (sized by this Compute, where the
        function runs) plus ``workers`` worker-node pods (default 1), sized by this Compute
        with ``worker_node_options`` applied (``{"cpus": "4", "memory": "16Gi", "gpus": 1}``).
        """
        if self.autoscaling is not None:
            raise ConfigError("a Compute cannot use both .autoscale() and .distribute(): autoscale() sends "
                              "each call to one of N interchangeable replicas, distribute() runs every call "
                              "on every rank of N pods; pick one")
        if unknown:
            raise ConfigError(f"distribute() got unknown option(s) {', '.join(sorted(unknown))}; "
                              "allowed: framework (distribution_type), workers, num_proc, port, "
                              "quorum_timeout, worker_node_options (framework='ray'), quorum_workers, "
                              "monitor_members, max_threads_per_proc, restart_procs, tree_fanout, "
                              "tree_minimum")
        if framework == "ray":
            if workers is None:
                workers = 1
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
                raise ConfigError(f"distribute('ray', workers={workers!r}): workers is the number of Ray "
                                  "worker nodes besides the head (0 for a head alone)")
            config = DistributedConfig(framework=framework, workers=workers + 1,
                                       num_proc=1 if num_proc is None else num_proc, port=port,
                                       quorum_timeout=quorum_timeout)
            if worker_node_options is not None and not isinstance(worker_node_options, dict):
                raise ConfigError(f"worker_node_options={worker_node_options!r} must be a dict of Compute "
                                  "fields, e.g. {'cpus': '4', 'memory': '16Gi', 'gpus': 1}")
            return replace(self, distributed=config, replicas=None, worker_node_options=(
                None if worker_node_options is None else dict(worker_node_options)))
        if worker_node_options is not None:
            raise ConfigError(f"distribute({framework!r}, worker_node_options=...): only framework='ray' "
                              "has worker nodes of their own size; for pods of different sizes use "
                              "num_proc=[...] (one entry per pod)")
        hosts = as_hosts(self.hosts)
        if hosts is not None:  # one pod per host, each with its own ranks unless given
            workers = len(hosts) if workers is None else workers
            if num_proc is None and any(n is not None for n in hosts.sizes):
                num_proc = [n or self.gpus or 1 for n in hosts.sizes]
        if num_proc is None:
            num_proc = self.gpus or 1
        if isinstance(num_proc, (list, tuple)) and not num_proc:
            raise ConfigError("num_proc=[] names no pod; give one rank count per pod, e.g. [4, 8, 2]")
        if workers is None:
            workers = len(num_proc) if isinstance(num_proc, (list, tuple)) else 1
        config = DistributedConfig(framework=framework, workers=workers, num_proc=num_proc,
                                   port=port, quorum_timeout=quorum_timeout)
        return replace(self, distributed=config, worker_node_options=None,
                       replicas=None if self.replicas is None else workers)

    def pod_fields(self) -> dict[str, Any]:
        """The fields that shape a pod: a change here restarts pods, anything else does not."""
        fields = asdict(self)
        for key in ("distributed", "launch_timeout", "stream_logs", "inactivity_ttl", "env_vars",
                    "max_restarts", "call_timeout", "teardown_timeout", "concurrency", "replicas", "autoscaling",
                    "restart_procs", "logging_config", "allowed_serialization", "kubeconfig_path",
                    "priority_class_name", "service_account_name", "shared_memory_limit",
                    "selector", "endpoint"):
            fields.pop(key, None)
        fields["secrets"] = [s.describe() for s in self.secrets]  # never values (see ktlite.secrets)
        return fields
