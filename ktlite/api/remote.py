"""``kt.fn`` and ``kt.cls``: ship a function or class to pods and call it like a local one.

The handles they deploy to are in :mod:`ktlite.api.handles`, their call adverbs in
:mod:`ktlite.api.adverbs`, handles on deployments attached by name in :mod:`ktlite.api.reattach`."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from ktlite.api.adverbs import _DEBUG_KWARGS as _DEBUG_KWARGS
from ktlite.api.adverbs import _KT_CALL_KWARGS as _KT_CALL_KWARGS
from ktlite.api.adverbs import _options as _options
from ktlite.api.compute import Compute
from ktlite.api.handles import RemoteClass, RemoteFunction, _Remote
from ktlite.api.reattach import _attach_by_name, _layout
from ktlite.backends.base import Plan
from ktlite.errors import ConfigError, NotDeployedError
from ktlite.modes.deploy import Deployment, attach, backend_of, deploy
from ktlite.modes.routing import Routing
from ktlite.net import packaging
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.naming import check_naming
from ktlite.specs.spec import check_name, default_name

__all__ = ["Cls", "Fn", "RemoteClass", "RemoteFunction", "cls", "fn"]


class _Source:
    kind = "fn"

    def __init__(self, obj: Any, name: str | None = None) -> None:
        self.obj = obj
        self.name = check_name(name) if name is not None else default_name(obj.__name__)

    def __repr__(self) -> str:
        return f"kt.{self.kind}({self.obj.__qualname__}, name={self.name!r})"

    @staticmethod
    def _own(compute: Compute) -> Compute:
        """The deployment's own copy of ``compute`` (distribute() changes the Compute it is
        called on), as ``.to()`` deploys it (``Compute(replicas=N)``: served)."""
        if not isinstance(compute, Compute):
            raise ConfigError(
                f".to() needs a kt.Compute, got {type(compute).__name__}; "
                "e.g. .to(kt.Compute(cpus=1))"
            )
        return replace(compute.served())

    def _spec(self, own: Compute, name: str | None, detached: bool) -> DeploymentSpec:
        """The spec of a deployment of ``own`` (see :meth:`_own`): its pods parsed once."""
        return DeploymentSpec(
            name=check_name(name) if name else self.name,
            pod=own.pod_spec(),
            kind=self.kind,
            detached=detached,
        )

    def _colocate(
        self, host: _Remote, name: str | None, dryrun: bool, init: bytes | None
    ) -> tuple[_Remote, str]:
        """Load this code into ``host``'s rank processes under its own target name."""
        if dryrun:
            raise ConfigError("dryrun=True is for new deployments; colocating creates no pods")
        if host._host is not None:  # colocating with a colocated target: the same processes
            host = host._host
        if host._deployment is None:
            raise ConfigError(
                f"cannot colocate {self.name!r} with {host._source.name!r}: that "
                "deployment was torn down; deploy it again first"
            )
        target = check_name(name) if name is not None else self.name
        bundle = packaging.bundle(self.obj)  # fails before anything is sent
        host.deployment.colocate(target, self.kind, bundle, packaging.local_sources(), init)
        return host, target

    def _existing(self, own: Compute, name: str | None) -> Deployment | None:
        """``get_if_exists=True``: the running deployment of this name as it is, or None.
        Its layout must be the one ``own`` asks for (calls are split by rank)."""
        spec = self._spec(own, name, False)
        try:
            dep = attach(spec)
        except NotDeployedError:
            return None
        routed = isinstance(dep.mode, Routing)  # what the Compute asks for
        runs_routed = (
            getattr(dep.applied, "autoscale", None) is not None
        )  # what the backend reports
        if routed or runs_routed:
            if routed != runs_routed:
                dep.close()
                what = "a fixed set of pods" if routed else "an autoscaled service"
                raise ConfigError(
                    f"get_if_exists=True: {spec.name!r} runs as {what}, unlike the Compute "
                    "given; deploy it again without get_if_exists"
                )
            return dep
        status = dep.client.status(dep.endpoints[0].url)
        running = _layout(status, len(dep.endpoints))
        asked = spec.distributed
        if (running.workers, running.sizes) != (asked.workers, asked.sizes) or status.get(
            "kind"
        ) not in (None, self.kind):
            dep.close()
            raise ConfigError(
                f"get_if_exists=True: {spec.name!r} runs as a {status.get('kind')} on "
                f"{running.workers} pod(s) x {list(running.sizes)} rank(s), but this asks for a "
                f"{self.kind} on {asked.workers} x {list(asked.sizes)}; deploy it again without "
                "get_if_exists, or match the running layout"
            )
        return dep

    def _deploy(
        self,
        own: Compute,
        name: str | None,
        detached: bool,
        dryrun: bool,
        restart_procs: bool,
        init: bytes | None,
    ) -> Deployment | Plan:
        spec = self._spec(own, name, detached)
        bundle = packaging.bundle(self.obj)  # fails before anything starts
        if dryrun:
            return backend_of(spec).plan(spec)
        return deploy(
            spec,
            bundle,
            packaging.local_sources(),
            init,
            restart=restart_procs or spec.pod.calls.restart_procs,
        )


class _ToAsync:
    async def to_async(self, *args: Any, **kwargs: Any) -> Any:
        """``.to(...)`` as a coroutine (Kubetorch's ``to_async``): the deploy runs in a thread,
        so several can be awaited together with ``asyncio.gather``."""
        import asyncio

        return await asyncio.to_thread(self.to, *args, **kwargs)  # type: ignore[attr-defined]


class Fn(_Source, _ToAsync):
    """A function ready to be deployed: ``kt.fn(train).to(kt.Compute(cpus=1))``."""

    kind = "fn"

    def to(
        self,
        compute: Compute | _Remote,
        *,
        name: str | None = None,
        detached: bool = False,
        dryrun: bool = False,
        restart_procs: bool = False,
        concurrency: int | None = None,
        get_if_exists: bool = False,
        stream_logs: bool | None = None,
        reload_prefixes: list[str] | None = None,
        prefix_username: bool | None = None,
        init_args: Any = None,
    ) -> RemoteFunction | Plan:
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
            raise ConfigError(
                "init_args= constructs a class; kt.fn deploys a function, which takes its "
                "arguments at each call"
            )
        check_naming(reload_prefixes, prefix_username)
        compute = _with_concurrency(_with_stream_logs(compute, stream_logs), concurrency)
        if isinstance(compute, _Remote):
            host, target = self._colocate(compute, name, dryrun, None)
            return RemoteFunction(self, host.deployment, host=host, target=target)
        own = self._own(compute)
        dep: Deployment | Plan | None = (
            self._existing(own, name) if get_if_exists and not dryrun else None
        )
        dep = dep or self._deploy(own, name, detached, dryrun, restart_procs, None)
        if isinstance(dep, Plan):
            return dep
        return RemoteFunction(self, dep, compute=own)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotDeployedError(f"{self!r} is not deployed: call .to(kt.Compute(...)) first")


class Cls(_Source, _ToAsync):
    """A class ready to be deployed: ``kt.cls(Model).to(compute, init_args={...})``."""

    kind = "cls"

    def to(
        self,
        compute: Compute | _Remote,
        init_args: dict[str, Any] | tuple[Any, ...] | list[Any] | None = None,
        *,
        name: str | None = None,
        detached: bool = False,
        dryrun: bool = False,
        restart_procs: bool = False,
        concurrency: int | None = None,
        get_if_exists: bool = False,
        stream_logs: bool | None = None,
        reload_prefixes: list[str] | None = None,
        prefix_username: bool | None = None,
    ) -> RemoteClass | Plan:
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
            raise ConfigError(
                f"init_args={init_args!r} must be a dict of keyword arguments or a "
                "tuple of positional arguments"
            )
        init = packaging.encode_value((args, kwargs), "init_args")
        check_naming(reload_prefixes, prefix_username)
        compute = _with_concurrency(_with_stream_logs(compute, stream_logs), concurrency)
        if isinstance(compute, _Remote):
            host, target = self._colocate(compute, name, dryrun, init)
            return RemoteClass(self, host.deployment, init_args, host=host, target=target)
        own = self._own(compute)
        dep: Deployment | Plan | None = (
            self._existing(own, name) if get_if_exists and not dryrun else None
        )
        dep = dep or self._deploy(own, name, detached, dryrun, restart_procs, init)
        if isinstance(dep, Plan):
            return dep
        return RemoteClass(self, dep, init_args, compute=own)


def _with_concurrency(compute: Any, concurrency: int | None) -> Any:
    """``.to(compute, concurrency=K)``: the same as ``Compute(concurrency=K)``."""
    if concurrency is None:
        return compute
    if not isinstance(compute, Compute):
        raise ConfigError(
            "concurrency= belongs to the deployment: a colocated group shares its host's; "
            "set it on the host's Compute"
        )
    return compute._with(concurrency=concurrency)


def _with_stream_logs(compute: Any, stream_logs: bool | None) -> Any:
    """``.to(compute, stream_logs=False)``: the calls' default (``Compute(stream_logs=...)``)."""
    if stream_logs is None:
        return compute
    if not isinstance(stream_logs, bool):
        raise ConfigError(f"stream_logs={stream_logs!r} must be True or False")
    if not isinstance(compute, Compute):
        raise ConfigError("stream_logs= belongs to the deployment: set it on the host's Compute")
    return compute._with(stream_logs=stream_logs)


def _check_sync(**given: Any) -> None:
    """Kubetorch's file-sync parameters of kt.fn / kt.cls: ktlite ships code by value."""
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise NotImplementedError(
            f"{', '.join(named)}: ktlite does not sync folders to pods or import code by path there; "
            "it ships the function or class by value with the local modules it imports (no "
            "rsync, no image rebuild). Data files: kt.put(key, path), then kt.get(key, dest) on the pods"
        )


def fn(
    func: Any = None,
    name: str | None = None,
    get_if_exists: bool = True,
    reload_prefixes: list[str] | None = None,
    prefix_username: bool | None = None,
    sync_dir: Any = None,
    remote_dir: Any = None,
    remote_import_path: Any = None,
) -> Any:
    """Wrap a function for deployment. Example: ``kt.fn(train).to(kt.Compute(cpus=1))(epochs=3)``.

    ``kt.fn(name="train")`` with no function attaches to the running deployment ``train``
    (deployed from another process): the result is called like the deployed function."""
    check_naming(reload_prefixes, prefix_username)
    _check_sync(sync_dir=sync_dir, remote_dir=remote_dir, remote_import_path=remote_import_path)
    if func is None:
        return _attach_by_name("fn", name, get_if_exists)
    if not inspect.isfunction(func) and not inspect.isbuiltin(func) and not callable(func):
        raise ConfigError(f"kt.fn() needs a function, got {type(func).__name__}")
    if inspect.isclass(func):
        raise ConfigError(
            f"kt.fn() got the class {func.__name__}; use kt.cls({func.__name__}) for classes"
        )
    return Fn(func, name)


def cls(
    klass: Any = None,
    name: str | None = None,
    get_if_exists: bool = True,
    reload_prefixes: list[str] | None = None,
    prefix_username: bool | None = None,
    sync_dir: Any = None,
    remote_dir: Any = None,
    remote_import_path: Any = None,
) -> Any:
    """Wrap a class for deployment. Example: ``kt.cls(Model).to(compute, init_args={"lr": 0.1})``.

    ``kt.cls(name="model")`` with no class attaches to the running deployment ``model``."""
    check_naming(reload_prefixes, prefix_username)
    _check_sync(sync_dir=sync_dir, remote_dir=remote_dir, remote_import_path=remote_import_path)
    if klass is None:
        return _attach_by_name("cls", name, get_if_exists)
    if not inspect.isclass(klass):
        raise ConfigError(
            f"kt.cls() needs a class, got {type(klass).__name__}; use kt.fn() for functions"
        )
    return Cls(klass, name)
