"""The handles of deployed code: :class:`RemoteFunction` and :class:`RemoteClass` (what
``kt.fn(f).to(...)`` and ``kt.cls(C).to(...)`` return): calls, status, logs, restart,
re-deploy and teardown of one deployment (or of one target colocated in another's)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Protocol

from ktlite.api import sharding
from ktlite.api.adverbs import (
    _KT_CALL_KWARGS,
    Bound,
    RemoteMethod,
    _check_serialization,
    _json_only,
    _options,
    _refuse_call_kwargs,
    _takes,
)
from ktlite.api.compute import Compute
from ktlite.api.futures import Future
from ktlite.backends.base import Backend
from ktlite.errors import ConfigError, NotDeployedError
from ktlite.modes.callpath import CallOptions
from ktlite.modes.deploy import Deployment
from ktlite.modes.serving_status import ServedHandle
from ktlite.net import packaging
from ktlite.net.rankdata import per_rank


class Source(Protocol):
    """What a handle was deployed from (``kt.fn(f)``, ``kt.cls(C)``, or a name attached to)."""

    kind: str
    obj: Any
    name: str

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


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
            raise AttributeError(
                f"{type(self).__name__} has no setting {attr!r}; settable: {', '.join(_SETTABLE)}"
            )
        if (
            attr in ("async_", "stream_logs")
            and not isinstance(value, bool)
            and not (attr == "stream_logs" and value is None)
        ):
            raise ConfigError(f"remote.{attr}={value!r} must be True or False")
        if attr == "serialization" and value is not None:
            _check_serialization(value)
        object.__setattr__(self, attr, value)

    def __init__(
        self,
        source: Source,
        deployment: Deployment,
        *,
        compute: Compute | None = None,
        host: _Remote | None = None,
        target: str | None = None,
    ) -> None:
        self._source = source
        self._deployment: Deployment | None = deployment
        # the caller's Compute it was deployed with (the deployment's spec keeps only the
        # parsed pod spec); a colocated handle's is its host's
        self._compute = compute
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
                raise NotDeployedError(
                    f"{self._source.name!r} was colocated with {self._host._source.name!r}, "
                    "which was torn down; deploy both again"
                )
            # the host's current deployment (a redeploy from the host's handle keeps the pods'
            # colocated targets)
            return self._host.deployment
        return self._deployment

    @property
    def compute(self) -> Compute:
        """The :class:`kt.Compute` this was deployed with (colocated: its host's)."""
        self.deployment  # noqa: B018 - torn down: NotDeployedError, naming what to do
        if self._host is not None:
            return self._host.compute
        if self._compute is None:
            raise ConfigError(
                f"{self._source.name!r} was made from a running deployment without its "
                "kt.Compute; its pods are described by remote.deployment.spec.pod"
            )
        return self._compute

    def __repr__(self) -> str:
        if self._host is not None:
            alive = self._deployment is not None and self._host._deployment is not None
            state = (
                f"colocated as {self._target!r} with {self._host._source.name!r}"
                if alive
                else "torn down"
            )
            return f"<{type(self).__name__} {self._source.name!r} on {self._source.kind}, {state}>"
        state = (
            "torn down" if self._deployment is None else f"{len(self.deployment.endpoints)} pod(s)"
        )
        return f"<{type(self).__name__} {self._source.name!r} on {self._source.kind}, {state}>"

    def _to_options(self) -> dict[str, Any]:
        """Keyword arguments of ``.to()`` that a re-deploy must repeat."""
        return {}

    def _redeploy(self, compute: Compute) -> None:
        new = self._source.to(compute, name=self.name, **self._to_options())
        old, self._deployment = self._deployment, new.deployment
        self._compute = new._compute
        if old is not None:
            # the pods keep colocated targets through a redeploy; pods the backend replaces
            # later get them pushed again with the code
            new.deployment.colocated.update(old.colocated)
            old.close()
            new.deployment.recolocate()

    def distribute(
        self,
        framework: str = "spmd",
        workers: int | None = None,
        num_proc: int | list[int] | None = None,
        port: int | None = None,
        quorum_timeout: float = 300.0,
        worker_node_options: dict[str, Any] | None = None,
        **unknown: Any,
    ) -> Any:
        """Re-deploy the same service on ``workers`` pods (the seed's ``.to(c).distribute(...)``);
        every option is checked before any pod changes."""
        if self._host is not None:
            raise ConfigError(
                f"{self._source.name!r} is colocated with {self._host._source.name!r}: "
                "distribute that deployment, then colocate again"
            )
        compute = replace(self.compute).distribute(
            framework, workers, num_proc, port, quorum_timeout, worker_node_options, **unknown
        )
        self._redeploy(compute)
        return self

    def _invoke(
        self,
        method: str | None,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: CallOptions | None,
        submit: bool = False,
    ) -> Any:
        serialization = None
        if options is None:
            taken = {
                k: kwargs.pop(k) for k in _KT_CALL_KWARGS if k in kwargs and not _takes(target, k)
            }
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
        call = (self._target, method) if self._host is not None else method
        parts, layout = packaging.encode_ranked_call(
            call, args, kwargs, dep.spec.distributed.world_size
        )
        single = dep.single  # the mode's: one value, or a list by rank
        if submit:
            label = method if method else str(getattr(target, "__name__", "call"))
            future = Future(dep.name, label, single=single)
            return dep.submit(method, parts, options, future, layout)
        values = dep.call(method, parts, options, per_rank=layout)
        if serialization == "json":  # what Kubetorch's JSON transport gives: lists for tuples
            values = [_json_only(v, f"rank {r}'s result") for r, v in enumerate(values)]
        return values[0] if single else values

    def _serialization(self, given: str | None, dep: Deployment) -> str:
        """The call's format: per call, else ``remote.serialization``, else pickle (JSON when
        the Compute allows only JSON); one ``allowed_serialization`` forbids is refused."""
        allowed = dep.spec.pod.calls.allowed_serialization
        chosen = (
            given
            or self.serialization
            or ("pickle" if allowed is None or "pickle" in allowed else "json")
        )
        if allowed is not None and chosen not in allowed:
            raise ConfigError(
                f"serialization={chosen!r} is not in this deployment's "
                f"allowed_serialization={list(allowed)}"
            )
        return chosen

    def _sharded(
        self,
        method: str | None,
        target: Any,
        data: Any,
        layout: dict[str, int],
        in_sharded_axes: Any,
        replicate_on_axes: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[Any]:
        lay = sharding.Layout(layout)
        world = self.deployment.spec.distributed.world_size
        if lay.size != world:
            raise ConfigError(
                f"layout={layout} covers {lay.size} rank(s) but the deployment has {world}"
            )
        if isinstance(in_sharded_axes, str) or isinstance(replicate_on_axes, str):
            raise ConfigError(
                "in_sharded_axes and replicate_on_axes are lists of axis names, e.g. ['dp']"
            )
        sharded = list(in_sharded_axes)
        replicated = (
            [a for a in lay.names if a not in sharded]
            if replicate_on_axes is None
            else list(replicate_on_axes)
        )
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
        pods: list[dict[str, Any]] = self.deployment.status(stuck_after)
        return pods

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
                self._host.deployment.colocate(
                    self._target or "", self._source.kind, None, {}, None, drop=True
                )
            self._deployment = None
            return
        dep = self._deployment
        if dep is None:
            if volumes and self._kept_volumes is not None:
                self._delete_volumes(*self._kept_volumes, timeout=timeout)
            return
        dep.teardown(volumes=volumes, timeout=timeout)
        self._deployment = None
        if not volumes:
            self._kept_volumes = (dep.backend, dep.name, dep.spec.pod.calls.teardown_timeout)

    def _delete_volumes(
        self, backend: Backend, name: str, default_timeout: float, *, timeout: float | None
    ) -> None:
        # a whole teardown is all a backend offers, and it would stop a deployment made since
        if backend.lookup(name) is not None:
            raise NotDeployedError(
                f"{name!r} was deployed again after this handle tore it down, and its volumes "
                f"belong to that deployment now; tear it down from its own handle with "
                f"teardown(volumes=True), or run `ktlite teardown {name} --volumes "
                f"--backend {backend.name}`"
            )
        backend.teardown(
            name, timeout=default_timeout if timeout is None else timeout, volumes=True
        )
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
        future: Future = self._invoke(None, self._source.obj, args, kwargs, None, submit=True)
        return future

    def each(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        """One call in which rank r gets ``items[r]`` as its first argument (and the other
        arguments shared): ``remote.each([shard0, shard1, ...], lr=0.1)``. Only rank r's pod
        receives ``items[r]``; ``len(items)`` must be the world size."""
        return self._invoke(None, self._source.obj, (per_rank(items), *args), kwargs, None)

    def sharded(
        self,
        data: Any,
        *args: Any,
        layout: dict[str, int],
        in_sharded_axes: Any,
        replicate_on_axes: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        """NeMo's ``run_all_workers_sharded_data``: the ranks as named axes (``layout={"dp": 2,
        "tp": 2}``, first axis outermost); ``data`` holds one shard per coordinate of
        ``in_sharded_axes`` (nested lists, in that order) and is replicated along
        ``replicate_on_axes`` (default: the other axes). Rank r gets its shard as the first
        argument; returns one result per shard, from the first rank of its replicated group."""
        return self._sharded(
            None, self._source.obj, data, layout, in_sharded_axes, replicate_on_axes, args, kwargs
        )

    def options(self, **options: Any) -> Bound:
        """Per-call options: ``remote.options(timeout=60, stream_logs=False, workers=[0], restart_procs=True)(x)``."""
        return Bound(self, None, self._source.obj, _options(options))


class RemoteClass(_Remote):
    """A deployed class: method calls run on the live instance(s); state persists between calls."""

    def __init__(
        self,
        source: Source,
        deployment: Deployment,
        init_args: Any,
        *,
        compute: Compute | None = None,
        host: _Remote | None = None,
        target: str | None = None,
    ) -> None:
        super().__init__(source, deployment, compute=compute, host=host, target=target)
        self._init_args = init_args

    def __getattr__(self, attr: str) -> RemoteMethod:
        if attr.startswith("_"):
            raise AttributeError(attr)
        klass = self._source.obj
        if klass is None:  # attached by name (kt.cls(name=...)): the pods know its methods
            return RemoteMethod(self, attr, None)
        member = inspect.getattr_static(klass, attr, None)
        if member is None or not callable(getattr(klass, attr, None)):
            raise AttributeError(
                f"{klass.__name__} has no method {attr!r}; remote instances expose "
                "their methods (add a getter method to read an attribute)"
            )
        return RemoteMethod(self, attr, getattr(klass, attr))

    def _to_options(self) -> dict[str, Any]:
        return {"init_args": self._init_args}
