"""``kt.fn`` and ``kt.cls``: ship a function or class to pods and call it like a local one."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import fields, replace
from typing import Any

from ktlite import packaging, sharding
from ktlite.backends.base import Backend, Plan
from ktlite.backends.registry import get_backend
from ktlite.compute import SERIALIZATIONS, Compute
from ktlite.deploy import CallOptions, Deployment, attach, deploy
from ktlite.deployment_spec import DeploymentSpec
from ktlite.errors import ConfigError, NotDeployedError, SerializationError
from ktlite.futures import Future
from ktlite.rankdata import per_rank
from ktlite.serving_status import ServedHandle
from ktlite.spec import check_name, default_name

# Kubetorch's call keywords, accepted as options only when the user's callable can't take them
_KT_CALL_KWARGS = ("stream_logs", "workers", "restart_procs")  # ranks= only through .options()
_OPTION_NAMES = tuple(f.name for f in fields(CallOptions))


def _options(kwargs: dict[str, Any]) -> CallOptions:
    unknown = sorted(set(kwargs) - set(_OPTION_NAMES))
    if unknown:
        raise ConfigError(f"unknown call option(s) {', '.join(unknown)}; allowed: {', '.join(_OPTION_NAMES)}")
    timeout = kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds (or None for no limit)")
    return CallOptions(**kwargs)


def _takes(fn: Any, name: str) -> bool:
    if fn is None:  # reattached by name: the code is not here; Kubetorch's keywords are ours
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # unknown signature: never steal the user's keywords
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.VAR_POSITIONAL)
               for p in params)


class _Source:
    kind = "fn"

    def __init__(self, obj: Any, name: str | None = None) -> None:
        self.obj = obj
        self.name = check_name(name) if name is not None else default_name(obj.__name__)

    def __repr__(self) -> str:
        return f"kt.{self.kind}({self.obj.__qualname__}, name={self.name!r})"

    def _spec(self, compute: Compute, name: str | None, detached: bool) -> DeploymentSpec:
        if not isinstance(compute, Compute):
            raise ConfigError(f".to() needs a kt.Compute, got {type(compute).__name__}; "
                              "e.g. .to(kt.Compute(cpus=1))")
        # the deployment's own copy: distribute() changes the Compute it is called on
        return DeploymentSpec(name=check_name(name) if name else self.name, compute=replace(compute.served()),
                              kind=self.kind, detached=detached)

    def _colocate(self, host: _Remote, name: str | None, dryrun: bool,
                  init: bytes | None) -> tuple[_Remote, str]:
        """Load this code into ``host``'s rank processes under its own target name."""
        if dryrun:
            raise ConfigError("dryrun=True is for new deployments; colocating creates no pods")
        if host._host is not None:  # colocating with a colocated target: the same processes
            host = host._host
        if host._deployment is None:
            raise ConfigError(f"cannot colocate {self.name!r} with {host._source.name!r}: that "
                              "deployment was torn down; deploy it again first")
        target = check_name(name) if name is not None else self.name
        bundle = packaging.bundle(self.obj)  # fails before anything is sent
        host.deployment.colocate(target, self.kind, bundle, packaging.local_sources(), init)
        return host, target

    def _existing(self, compute: Compute, name: str | None) -> Deployment | None:
        """``get_if_exists=True``: the running deployment of this name as it is, or None.
        Its layout must be the one ``compute`` asks for (calls are split by rank)."""
        spec = self._spec(compute, name, False)
        try:
            dep = attach(spec)
        except NotDeployedError:
            return None
        if spec.autoscale is not None or getattr(dep.applied, "autoscale", None) is not None:
            if spec.autoscale is None or dep.applied.autoscale is None:
                dep.close()
                what = "an autoscaled service" if spec.autoscale is None else "a fixed set of pods"
                raise ConfigError(f"get_if_exists=True: {spec.name!r} runs as {what}, unlike the Compute "
                                  "given; deploy it again without get_if_exists")
            return dep
        status = dep.client.status(dep.endpoints[0].url)
        running = _layout(status, len(dep.endpoints))
        asked = spec.distributed
        if (running.workers, running.sizes) != (asked.workers, asked.sizes) or \
                status.get("kind") not in (None, self.kind):
            dep.close()
            raise ConfigError(f"get_if_exists=True: {spec.name!r} runs as a {status.get('kind')} on "
                f"{running.workers} pod(s) x {list(running.sizes)} rank(s), but this asks for a "
                f"{self.kind} on {asked.workers} x {list(asked.sizes)}; deploy it again without "
                "get_if_exists, or match the running layout")
        return dep

    def _deploy(self, compute: Compute, name: str | None, detached: bool, dryrun: bool,
                restart_procs: bool, init: bytes | None) -> Deployment | Plan:
        spec = self._spec(compute, name, detached)
        bundle = packaging.bundle(self.obj)  # fails before anything starts
        if dryrun:
            return get_backend(compute.backend, compute.namespace, compute.kubeconfig_path).plan(spec)
        return deploy(spec, bundle, packaging.local_sources(), init,
                      restart=restart_procs or compute.restart_procs)


class _ToAsync:
    async def to_async(self, *args: Any, **kwargs: Any) -> Any:
        """``.to(...)`` as a coroutine (Kubetorch's ``to_async``): the deploy runs in a thread,
        so several can be awaited together with ``asyncio.gather``."""
        import asyncio

        return await asyncio.to_thread(self.to, *args, **kwargs)  # type: ignore[attr-defined]


class Fn(_Source, _ToAsync):
    """A function ready to be deployed: ``kt.fn(train).to(kt.Compute(cpus=1))``."""

    kind = "fn"

    def to(self, compute: Compute | _Remote, *, name: str | None = None, detached: bool = False,
           dryrun: bool = False, restart_procs: bool = False, concurrency: int | None = None,
           get_if_exists: bool = False, stream_logs: bool | None = None,
           reload_prefixes: list[str] | None = None, prefix_username: bool | None = None,
           init_args: Any = None) -> RemoteFunction | Plan:
        """Deploy onto ``compute``; returns a callable :class:`RemoteFunction`.

        Args:
            compute: where to run; ``compute.distribute(...)`` for N pods × P ranks; or a
                deployed ``RemoteClass``/``RemoteFunction`` to colocate with (see
                :meth:`Cls.to`): no new pods, the function joins its rank processes.
            name: deployment name (default: the function's name).
            detached: keep the pods running after this Python process exits.
            dryrun: touch nothing; return the :class:`Plan` (commands or manifests).
            restart_procs: start fresh rank processes instead of reloading code into them.
            concurrency: calls each rank process runs at once (``Compute(concurrency=K)``).
            get_if_exists: if ``name`` already runs, use it as it is (no new code is sent).
            stream_logs: the calls' default for streaming rank output (``Compute.stream_logs``).
        """
        if init_args is not None:
            raise ConfigError("init_args= constructs a class; kt.fn deploys a function, which takes its "
                              "arguments at each call")
        _check_naming(reload_prefixes, prefix_username)
        compute = _with_concurrency(_with_stream_logs(compute, stream_logs), concurrency)
        if isinstance(compute, _Remote):
            host, target = self._colocate(compute, name, dryrun, None)
            return RemoteFunction(self, host.deployment, host=host, target=target)
        dep = self._existing(compute, name) if get_if_exists and not dryrun else None
        dep = dep or self._deploy(compute, name, detached, dryrun, restart_procs, None)
        if isinstance(dep, Plan):
            return dep
        return RemoteFunction(self, dep)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotDeployedError(f"{self!r} is not deployed: call .to(kt.Compute(...)) first")


class Cls(_Source, _ToAsync):
    """A class ready to be deployed: ``kt.cls(Model).to(compute, init_args={...})``."""

    kind = "cls"

    def to(self, compute: Compute | _Remote,
           init_args: dict[str, Any] | tuple[Any, ...] | list[Any] | None = None, *,
           name: str | None = None, detached: bool = False, dryrun: bool = False,
           restart_procs: bool = False, concurrency: int | None = None, get_if_exists: bool = False,
           stream_logs: bool | None = None, reload_prefixes: list[str] | None = None,
           prefix_username: bool | None = None) -> RemoteClass | Plan:
        """Deploy onto ``compute`` and construct one instance per rank.

        Args:
            compute: a :class:`kt.Compute` (new pods), or a deployed ``RemoteClass`` /
                ``RemoteFunction`` to colocate with.
            init_args: constructor arguments: a dict of keywords, or a tuple/list of positionals.
            name: the deployment's name; colocated, the target's name in the rank processes
                (default: the class's name; colocating a name again replaces that target).
            concurrency: calls each rank process runs at once (``Compute(concurrency=K)``;
                default 8 for a single-rank class, 1 when distributed).

        Colocation (``gen = kt.cls(Gen).to(policy, init_args=...)``): the class is loaded into
        the rank processes of ``policy``'s deployment and constructed on every rank, beside
        ``policy``'s own instance. Shared with ``policy``: the pods, their GPUs, the rank
        process itself (so torch.distributed's default process group that ``policy``'s code
        initialised is usable from ``gen``'s methods, and vice versa), and the deployment's
        call queue: calls on either run in turn, one at a time on a distributed deployment,
        through the same coordinator, and return one result per rank. Not shared: instance
        state (``gen`` is its own object) and the target name. No pods or token are created.
        The colocated instance lives across calls and across redeploys of ``policy``'s code
        in the same processes; a restarted rank process constructs every target again (with
        its init args). ``gen.teardown()`` removes only ``gen``'s instances; ``policy.teardown()``
        stops the pods and with them every colocated target. ``gen.status()`` is the
        deployment's status (each rank lists its loaded ``targets``).
        """
        if init_args is None:
            args, kwargs = (), {}
        elif isinstance(init_args, dict):
            args, kwargs = (), dict(init_args)
        elif isinstance(init_args, (tuple, list)):
            args, kwargs = tuple(init_args), {}
        else:
            raise ConfigError(f"init_args={init_args!r} must be a dict of keyword arguments or a "
                              "tuple of positional arguments")
        init = packaging.encode_value((args, kwargs), "init_args")
        _check_naming(reload_prefixes, prefix_username)
        compute = _with_concurrency(_with_stream_logs(compute, stream_logs), concurrency)
        if isinstance(compute, _Remote):
            host, target = self._colocate(compute, name, dryrun, init)
            return RemoteClass(self, host.deployment, init_args, host=host, target=target)
        dep = self._existing(compute, name) if get_if_exists and not dryrun else None
        dep = dep or self._deploy(compute, name, detached, dryrun, restart_procs, init)
        if isinstance(dep, Plan):
            return dep
        return RemoteClass(self, dep, init_args)


def _with_concurrency(compute: Any, concurrency: int | None) -> Any:
    """``.to(compute, concurrency=K)``: the same as ``Compute(concurrency=K)``."""
    if concurrency is None:
        return compute
    if not isinstance(compute, Compute):
        raise ConfigError("concurrency= belongs to the deployment: a colocated group shares its host's; "
                          "set it on the host's Compute")
    return replace(compute, concurrency=concurrency)


def _check_serialization(value: Any) -> str:
    if value == "none":
        raise ConfigError("serialization='none' (raw bytes) is not supported; use 'pickle' (any Python "
                          "object, the default) or 'json'")
    if value not in SERIALIZATIONS:
        raise ConfigError(f"serialization={value!r}; allowed: {', '.join(map(repr, SERIALIZATIONS))}")
    return str(value)


def _json_only(value: Any, what: str) -> Any:
    """``value`` as JSON gives it back (tuples become lists); refused if it is not JSON."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise SerializationError(f"serialization='json': {what} are not JSON ({e}); pass JSON values "
                                 "(dict, list, str, numbers, bool, None) or use serialization='pickle'"
                                 ) from None


_DEBUG_KWARGS = ("debug", "pdb")


def _refuse_call_kwargs(kwargs: dict[str, Any], target: Any) -> None:
    """Kubetorch's per-call keywords that ktlite does not have, refused before the call."""
    for key in _DEBUG_KWARGS:
        if key in kwargs and not _takes(target, key):
            raise NotImplementedError(
                f"{key}=...: ktlite has no remote debugger. A ktlite function is a plain Python function: "
                "call it in this process to step through it; remote.logs(rank=R) shows a rank's output "
                "and remote.status() what every rank is doing")
    if "stream_metrics" in kwargs and not _takes(target, "stream_metrics") and kwargs.pop("stream_metrics"):
        raise NotImplementedError("stream_metrics=True: ktlite streams no metrics during calls; "
                                  "remote.status() (or `ktlite status NAME --watch`) shows each rank's "
                                  "CPU, memory and GPU use")


def _with_stream_logs(compute: Any, stream_logs: bool | None) -> Any:
    """``.to(compute, stream_logs=False)``: the calls' default (``Compute(stream_logs=...)``)."""
    if stream_logs is None:
        return compute
    if not isinstance(stream_logs, bool):
        raise ConfigError(f"stream_logs={stream_logs!r} must be True or False")
    if not isinstance(compute, Compute):
        raise ConfigError("stream_logs= belongs to the deployment: set it on the host's Compute")
    return replace(compute, stream_logs=stream_logs)


def _check_naming(reload_prefixes: Any, prefix_username: Any) -> None:
    from ktlite.decorators import _check_naming as check
    check(reload_prefixes, prefix_username)


def _check_sync(**given: Any) -> None:
    """Kubetorch's file-sync parameters of kt.fn / kt.cls: ktlite ships code by value."""
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise NotImplementedError(
            f"{', '.join(named)}: ktlite does not sync folders to pods or import code by path there; "
            "it ships the function or class by value with the local modules it imports (no "
            "rsync, no image rebuild). Data files: kt.put(key, path), then kt.get(key, dest) on the pods")


def _layout(status: dict[str, Any], pods: int) -> Any:
    """The running deployment's layout, as its pod 0 reports it."""
    from ktlite.spec import DistributedConfig

    layout = status.get("layout") or {}
    if layout.get("distributed"):
        return DistributedConfig(**layout["distributed"])
    return DistributedConfig(workers=pods, num_proc=max(1, len(status.get("ranks") or [])))


def _reattach(kind: str, name: str, backend: str | None = None,
              namespace: str | None = None) -> RemoteFunction | RemoteClass:
    """``kt.fn(name="svc")`` / ``kt.cls(name="svc")``: a handle on a running deployment whose
    code is not here (deployed by another process, notebook or ``ktlite deploy``)."""
    from ktlite.deploy import Deployment

    name = check_name(name)
    be = get_backend(backend, namespace)
    applied = be.lookup(name)
    if applied is None:
        raise NotDeployedError(f"no deployment {name!r} on backend {be.name!r} to attach to; deploy it "
                               f"with kt.{kind}(obj).to(compute) or `ktlite deploy` (`ktlite list` shows "
                               "what runs)")
    if applied.autoscale is not None:
        return _reattach_served(kind, name, be, applied, namespace)
    dep = Deployment(DeploymentSpec(name, Compute(backend=be.name, namespace=namespace), kind=kind),
                     be, applied)
    status = dep.client.status(applied.endpoints[0].url)
    running = status.get("kind")
    if running not in (None, kind):
        dep.close()
        other = "kt.cls" if running == "cls" else "kt.fn"
        raise ConfigError(f"{name!r} runs a {'class' if running == 'cls' else 'function'}: attach with "
                          f"{other}(name={name!r})")
    single = bool((status.get("layout") or {}).get("single"))
    compute = Compute(backend=be.name, namespace=namespace,
                      distributed=None if single else _layout(status, len(applied.endpoints)))
    dep.spec = DeploymentSpec(name, compute, kind=kind)
    source = _Named(kind, name)
    return RemoteClass(source, dep, None) if kind == "cls" else RemoteFunction(source, dep)


def _reattach_served(kind: str, name: str, be: Backend, applied: Any,
                     namespace: str | None) -> RemoteFunction | RemoteClass:
    """:func:`_reattach` for an autoscaled service (it may run no replica now)."""
    from ktlite.autoscaling import AutoscaleConfig
    from ktlite.serving import ServingDeployment

    compute = Compute(backend=be.name, namespace=namespace, autoscaling=AutoscaleConfig(**applied.autoscale))
    spec = DeploymentSpec(name, compute, kind=kind)
    dep = ServingDeployment(spec, be, applied)
    if applied.endpoints:
        running = dep.client.status(applied.endpoints[0].url).get("kind")
        if running not in (None, kind):
            dep.close()
            raise ConfigError(f"{name!r} runs a {'class' if running == 'cls' else 'function'}: attach with "
                              f"kt.{'cls' if running == 'cls' else 'fn'}(name={name!r})")
    dep.adopt()
    source = _Named(kind, name)
    return RemoteClass(source, dep, None) if kind == "cls" else RemoteFunction(source, dep)


def _attach_by_name(kind: str, name: str | None, get_if_exists: bool) -> RemoteFunction | RemoteClass:
    """``kt.fn(name=...)`` / ``kt.cls(name=...)`` with no code: the running deployment."""
    what = "function" if kind == "fn" else "class"
    if name is None:
        raise ConfigError(f"kt.{kind}() needs a {what}, or name= of a running deployment to attach to")
    if not get_if_exists:
        raise ConfigError(f"kt.{kind}(name={name!r}, get_if_exists=False) has nothing to deploy: pass the {what}")
    return _reattach(kind, name)


def fn(func: Any = None, name: str | None = None, get_if_exists: bool = True,
       reload_prefixes: list[str] | None = None, prefix_username: bool | None = None,
       sync_dir: Any = None, remote_dir: Any = None, remote_import_path: Any = None) -> Any:
    """Wrap a function for deployment. Example: ``kt.fn(train).to(kt.Compute(cpus=1))(epochs=3)``.

    ``kt.fn(name="train")`` with no function attaches to the running deployment ``train``
    (deployed from another process): the result is called like the deployed function."""
    _check_naming(reload_prefixes, prefix_username)
    _check_sync(sync_dir=sync_dir, remote_dir=remote_dir, remote_import_path=remote_import_path)
    if func is None:
        return _attach_by_name("fn", name, get_if_exists)
    if not inspect.isfunction(func) and not inspect.isbuiltin(func) and not callable(func):
        raise ConfigError(f"kt.fn() needs a function, got {type(func).__name__}")
    if inspect.isclass(func):
        raise ConfigError(f"kt.fn() got the class {func.__name__}; use kt.cls({func.__name__}) for classes")
    return Fn(func, name)


def cls(klass: Any = None, name: str | None = None, get_if_exists: bool = True,
        reload_prefixes: list[str] | None = None, prefix_username: bool | None = None,
        sync_dir: Any = None, remote_dir: Any = None, remote_import_path: Any = None) -> Any:
    """Wrap a class for deployment. Example: ``kt.cls(Model).to(compute, init_args={"lr": 0.1})``.

    ``kt.cls(name="model")`` with no class attaches to the running deployment ``model``."""
    _check_naming(reload_prefixes, prefix_username)
    _check_sync(sync_dir=sync_dir, remote_dir=remote_dir, remote_import_path=remote_import_path)
    if klass is None:
        return _attach_by_name("cls", name, get_if_exists)
    if not inspect.isclass(klass):
        raise ConfigError(f"kt.cls() needs a class, got {type(klass).__name__}; use kt.fn() for functions")
    return Cls(klass, name)


class _Named(_Source):
    """The source of a deployment attached by name: its code is on the pods, not here."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.obj, self.name = kind, None, name

    def __repr__(self) -> str:
        return f"kt.{self.kind}(name={self.name!r})"

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{self!r} was attached by name and its code is not here: deploy it again "
                          f"from kt.{self.kind}(obj, name={self.name!r})")


# what a Kubetorch user may set on a deployed handle (``remote.async_ = True``); anything
# else is refused rather than silently stored
_SETTABLE = ("async_", "serialization", "stream_logs")


class _Remote(ServedHandle):
    # Kubetorch's handle attributes: calls return a kt.Future (awaitable); how arguments and
    # results travel ("pickle", or "json": JSON values only, as Kubetorch's default); the
    # calls' default for streaming rank output
    async_: bool = False
    serialization: str | None = None
    stream_logs: bool | None = None

    def __setattr__(self, attr: str, value: Any) -> None:
        if not attr.startswith("_") and attr not in _SETTABLE:
            raise AttributeError(f"{type(self).__name__} has no setting {attr!r}; settable: "
                                 f"{', '.join(_SETTABLE)}")
        if attr in ("async_", "stream_logs") and not isinstance(value, bool) and \
                not (attr == "stream_logs" and value is None):
            raise ConfigError(f"remote.{attr}={value!r} must be True or False")
        if attr == "serialization" and value is not None:
            _check_serialization(value)
        object.__setattr__(self, attr, value)

    def __init__(self, source: _Source, deployment: Deployment, *, host: _Remote | None = None,
                 target: str | None = None) -> None:
        self._source = source
        self._deployment: Deployment | None = deployment
        # colocated (``kt.cls(B).to(remote_a)``): the handle whose deployment this one's code
        # lives in, and this code's target name in its rank processes
        self._host = host
        self._target = target
        # after a teardown without volumes=True: where its volumes still are (backend, name,
        # default timeout), so that teardown(volumes=True) on this handle can delete them
        self._kept_volumes: tuple[Backend, str, float] | None = None

    @property
    def name(self) -> str:
        return self.deployment.name

    @property
    def target(self) -> str | None:
        """Colocated: this code's target name in the host deployment's rank processes."""
        return self._target

    @property
    def deployment(self) -> Deployment:
        if self._deployment is None:
            raise NotDeployedError(f"{self._source.name!r} was torn down; call .to(compute) again")
        if self._host is not None:
            if self._host._deployment is None:
                raise NotDeployedError(f"{self._source.name!r} was colocated with {self._host._source.name!r}, "
                                       "which was torn down; deploy both again")
            # the host's current deployment (a redeploy from the host's handle keeps the pods'
            # colocated targets)
            return self._host.deployment
        return self._deployment

    @property
    def compute(self) -> Compute:
        return self.deployment.spec.compute

    def __repr__(self) -> str:
        if self._host is not None:
            alive = self._deployment is not None and self._host._deployment is not None
            state = f"colocated as {self._target!r} with {self._host._source.name!r}" if alive else "torn down"
            return f"<{type(self).__name__} {self._source.name!r} on {self._source.kind}, {state}>"
        state = "torn down" if self._deployment is None else f"{len(self.deployment.endpoints)} pod(s)"
        return f"<{type(self).__name__} {self._source.name!r} on {self._source.kind}, {state}>"

    def _to_options(self) -> dict[str, Any]:
        """Keyword arguments of ``.to()`` that a re-deploy must repeat."""
        return {}

    def _redeploy(self, compute: Compute) -> None:
        new = self._source.to(compute, name=self.name, **self._to_options())  # type: ignore[attr-defined]
        old, self._deployment = self._deployment, new.deployment
        if old is not None:
            # the pods keep colocated targets through a redeploy; pods the backend replaces
            # later get them pushed again with the code
            new.deployment.colocated.update(old.colocated)
            old.close()
            new.deployment.recolocate()

    def distribute(self, framework: str = "spmd", workers: int | None = None, num_proc: int | list[int] | None = None,
                   port: int | None = None, quorum_timeout: float = 300.0,
                   worker_node_options: dict[str, Any] | None = None, **unknown: Any) -> Any:
        """Re-deploy the same service on ``workers`` pods (the seed's ``.to(c).distribute(...)``);
        every option is checked before any pod changes."""
        if self._host is not None:
            raise ConfigError(f"{self._source.name!r} is colocated with {self._host._source.name!r}: "
                              "distribute that deployment, then colocate again")
        compute = replace(self.compute).distribute(framework, workers, num_proc, port, quorum_timeout,
                                                   worker_node_options, **unknown)
        self._redeploy(compute)
        return self

    def _invoke(self, method: str | None, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                options: CallOptions | None, submit: bool = False) -> Any:
        serialization = None
        if options is None:
            taken = {k: kwargs.pop(k) for k in _KT_CALL_KWARGS if k in kwargs and not _takes(target, k)}
            # Kubetorch's async_=True: a future (awaitable), unless the function takes async_
            if "async_" in kwargs and not _takes(target, "async_"):
                submit = bool(kwargs.pop("async_")) or submit
            if "serialization" in kwargs and not _takes(target, "serialization"):
                serialization = _check_serialization(kwargs.pop("serialization"))
            _refuse_call_kwargs(kwargs, target)
            options = _options(taken)
        submit = submit or self.async_
        if options.stream_logs is None and self.stream_logs is not None:
            options = replace(options, stream_logs=self.stream_logs)
        dep = self.deployment
        serialization = self._serialization(serialization, dep)
        if serialization == "json":
            _json_only((args, kwargs), "the arguments")
        call = (self._target, method) if self._host is not None else method  # type: ignore[attr-defined]
        parts, layout = packaging.encode_ranked_call(call, args, kwargs, dep.spec.distributed.world_size)
        single = dep.spec.compute.distributed is None or dep.spec.distributed.engine
        if submit:
            future = Future(dep.name, method or getattr(target, "__name__", "call"), single=single)
            return dep.submit(method, parts, options, future, layout)
        values = dep.call(method, parts, options, per_rank=layout)
        if serialization == "json":  # what Kubetorch's JSON transport gives: lists for tuples
            values = [_json_only(v, f"rank {r}'s result") for r, v in enumerate(values)]
        return values[0] if single else values

    def _serialization(self, given: str | None, dep: Deployment) -> str:
        """The call's format: per call, else ``remote.serialization``, else pickle (JSON when
        the Compute allows only JSON); one ``allowed_serialization`` forbids is refused."""
        allowed = dep.spec.compute.allowed_serialization
        chosen = given or self.serialization or ("pickle" if allowed is None or "pickle" in allowed
                                                  else "json")
        if allowed is not None and chosen not in allowed:
            raise ConfigError(f"serialization={chosen!r} is not in this deployment's "
                              f"allowed_serialization={list(allowed)}")
        return chosen

    def _sharded(self, method: str | None, target: Any, data: Any, layout: dict[str, int],
                 in_sharded_axes: Any, replicate_on_axes: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> list[Any]:
        lay = sharding.Layout(layout)
        world = self.deployment.spec.distributed.world_size
        if lay.size != world:
            raise ConfigError(f"layout={layout} covers {lay.size} rank(s) but the deployment has {world}")
        if isinstance(in_sharded_axes, str) or isinstance(replicate_on_axes, str):
            raise ConfigError("in_sharded_axes and replicate_on_axes are lists of axis names, e.g. ['dp']")
        sharded = list(in_sharded_axes)
        replicated = [a for a in lay.names if a not in sharded] if replicate_on_axes is None else list(replicate_on_axes)
        lay.check_axes(sharded, replicated)
        shards = sharding.flatten_shards(data, lay, sharded)
        items = [shards[lay.shard_index(r, sharded)] for r in range(world)]
        values = self._invoke(method, target, (per_rank(items), *args), kwargs, None)
        return [values[r] for r in lay.leaders(sharded, replicated)]

    def status(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        """Each pod's status, in ordinal order: a dict with ``pod``, ``ordinal``, ``launch_id``,
        ``active_calls`` and ``ranks``, one dict per rank with:

        - ``rank``, ``local_rank``, ``pid``, ``state`` (idle/busy/dead), ``restarts``, ``last_exit``;
        - ``busy_for_s`` and ``stuck``: busy with one call for longer than ``stuck_after``
          seconds (default 600);
        - ``calls``: the calls the rank runs now, each ``{"id", "running_s"}``;
        - ``cpu_percent`` (100 = one core), ``rss_bytes`` and ``procs``: the rank process
          and every process it started, read by the pod server from /proc;
        - ``gpu_memory_used_bytes``, ``gpu_memory_total_bytes``, ``gpu_utilization_percent``,
          ``gpu_process_memory_bytes`` and ``gpus`` (each GPU the rank sees): from
          ``nvidia-smi`` on the pod; None where the pod has none.

        Example:
            for pod in remote.status():
                for r in pod["ranks"]:
                    print(r["rank"], r["cpu_percent"], r["rss_bytes"] >> 20, "MiB")
        """
        return self.deployment.status(stuck_after)

    def restart_failed(self) -> dict[str, Any]:
        """Restart the rank processes that died, and only those: the others keep their
        process and state (a ``kt.cls`` instance lives on). Returns ``{"restarted": [ranks],
        "failed": [{"rank", "status", "message"}], "pods": [...]}``. Dead ranks are also
        restarted by themselves before the next call (within ``max_restarts``). The next
        ``init_process_group`` in a call forms a new process group across all ranks."""
        return self.deployment.restart_failed()

    def teardown(self, volumes: bool = False, timeout: float | None = None) -> None:
        """Stop every pod and process of this deployment and delete what it created;
        its volumes (PVCs) too when ``volumes=True``. Waits up to ``timeout`` seconds
        (default ``Compute.teardown_timeout``) for pods to stop, then kills them (local) or
        raises naming the pods still terminating (Kubernetes).

        Once torn down, ``teardown(volumes=True)`` still deletes the volumes that a plain
        teardown kept; another plain teardown does nothing."""
        if self._host is not None:  # only this target: the pods and the host's code stay
            if self._deployment is not None and self._host._deployment is not None:
                self._host.deployment.colocate(self._target or "", self._source.kind, None, {}, None,
                                               drop=True)
            self._deployment = None
            return
        dep = self._deployment
        if dep is None:
            if volumes and self._kept_volumes is not None:
                self._delete_volumes(*self._kept_volumes, timeout=timeout)
            return
        limit = dep.spec.compute.teardown_timeout if timeout is None else timeout
        dep.fail_queued()  # submitted calls that have not started never will
        dep.backend.teardown(dep.name, timeout=limit, volumes=volumes)
        for ep in dep.endpoints:
            dep.client.forget(ep.url)
        dep.close()
        self._deployment = None
        if not volumes:
            self._kept_volumes = (dep.backend, dep.name, dep.spec.compute.teardown_timeout)

    def _delete_volumes(self, backend: Backend, name: str, default_timeout: float, *,
                        timeout: float | None) -> None:
        # a whole teardown is all a backend offers, and it would stop a deployment made since
        if backend.lookup(name) is not None:
            raise NotDeployedError(
                f"{name!r} was deployed again after this handle tore it down, and its volumes "
                f"belong to that deployment now; tear it down from its own handle with "
                f"teardown(volumes=True), or run `ktlite teardown {name} --volumes "
                f"--backend {backend.name}`")
        backend.teardown(name, timeout=default_timeout if timeout is None else timeout, volumes=True)
        self._kept_volumes = None

    def logs(self, rank: int | None = None, follow: bool = False, tail: int | None = None) -> str:
        """The pods' logs (rank output appears as ``[rank R] line``), each line prefixed with
        its pod; only the pod holding ``rank`` if given. ``follow=True`` prints new lines as
        they come until interrupted (Ctrl-C) and returns what it printed."""
        dep = self.deployment
        ordinal = None
        if rank is not None:
            world = dep.spec.distributed.world_size
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
                raise ConfigError(f"rank={rank!r}: give a rank between 0 and {world - 1}")
            ordinal = dep.spec.distributed.ordinal_of(rank)
        lines = dep.backend.logs(dep.name, ordinal, follow=follow, tail=tail)
        if not follow:
            return "\n".join(lines)
        seen = []
        try:
            for line in lines:
                print(line, flush=True)
                seen.append(line)
        except KeyboardInterrupt:
            pass
        return "\n".join(seen)


class RemoteFunction(_Remote):
    """A deployed function: call it like the original; distributed, it returns a list by rank."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._invoke(None, self._source.obj, args, kwargs, None)

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """Start the call and return a :class:`kt.Future` at once (awaitable; works with
        ``concurrent.futures.wait``/``as_completed``). Submitted calls leave in order."""
        return self._invoke(None, self._source.obj, args, kwargs, None, submit=True)

    def each(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        """One call in which rank r gets ``items[r]`` as its first argument (and the other
        arguments shared): ``remote.each([shard0, shard1, ...], lr=0.1)``. Only rank r's pod
        receives ``items[r]``; ``len(items)`` must be the world size."""
        return self._invoke(None, self._source.obj, (per_rank(items), *args), kwargs, None)

    def sharded(self, data: Any, *args: Any, layout: dict[str, int], in_sharded_axes: Any,
                replicate_on_axes: Any = None, **kwargs: Any) -> list[Any]:
        """NeMo's ``run_all_workers_sharded_data``: the ranks as named axes (``layout={"dp": 2,
        "tp": 2}``, first axis outermost); ``data`` holds one shard per coordinate of
        ``in_sharded_axes`` (nested lists, in that order) and is replicated along
        ``replicate_on_axes`` (default: the other axes). Rank r gets its shard as the first
        argument; returns one result per shard, from the first rank of its replicated group."""
        return self._sharded(None, self._source.obj, data, layout, in_sharded_axes, replicate_on_axes,
                             args, kwargs)

    def options(self, **options: Any) -> _Bound:
        """Per-call options: ``remote.options(timeout=60, stream_logs=False, workers=[0], restart_procs=True)(x)``."""
        return _Bound(self, None, self._source.obj, _options(options))



class RemoteClass(_Remote):
    """A deployed class: method calls run on the live instance(s); state persists between calls."""

    def __init__(self, source: Cls, deployment: Deployment, init_args: Any, *,
                 host: _Remote | None = None, target: str | None = None) -> None:
        super().__init__(source, deployment, host=host, target=target)
        self._init_args = init_args

    def __getattr__(self, attr: str) -> RemoteMethod:
        if attr.startswith("_"):
            raise AttributeError(attr)
        klass = self._source.obj
        if klass is None:  # attached by name (kt.cls(name=...)): the pods know its methods
            return RemoteMethod(self, attr, None)
        member = inspect.getattr_static(klass, attr, None)
        if member is None or not callable(getattr(klass, attr, None)):
            raise AttributeError(f"{klass.__name__} has no method {attr!r}; remote instances expose "
                                 "their methods (add a getter method to read an attribute)")
        return RemoteMethod(self, attr, getattr(klass, attr))

    def _to_options(self) -> dict[str, Any]:
        return {"init_args": self._init_args}


class RemoteMethod:
    def __init__(self, owner: RemoteClass, name: str, target: Any) -> None:
        self._owner = owner
        self._name = name
        self._target = target

    def __repr__(self) -> str:
        return f"<RemoteMethod {self._owner.name}.{self._name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._invoke(self._name, self._target, args, kwargs, None)

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """The method call as a :class:`kt.Future`, returned at once."""
        return self._owner._invoke(self._name, self._target, args, kwargs, None, submit=True)

    def each(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        """The method on every rank, rank r getting ``items[r]`` first (see RemoteFunction.each)."""
        return self._owner._invoke(self._name, self._target, (per_rank(items), *args), kwargs, None)

    def sharded(self, data: Any, *args: Any, layout: dict[str, int], in_sharded_axes: Any,
                replicate_on_axes: Any = None, **kwargs: Any) -> list[Any]:
        """The method with sharded data (see RemoteFunction.sharded)."""
        return self._owner._sharded(self._name, self._target, data, layout, in_sharded_axes,
                                    replicate_on_axes, args, kwargs)

    def options(self, **options: Any) -> _Bound:
        return _Bound(self._owner, self._name, self._target, _options(options))


class _Bound:
    """A call with options fixed: every keyword argument goes to the user's function."""

    def __init__(self, remote: _Remote, method: str | None, target: Any, options: CallOptions) -> None:
        self._remote, self._method, self._target, self._opts = remote, method, target, options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote._invoke(self._method, self._target, args, kwargs, self._opts)

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        return self._remote._invoke(self._method, self._target, args, kwargs, self._opts, submit=True)
