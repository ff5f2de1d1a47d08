"""``@kt.compute`` and ``@kt.distribute``: mark a function or class for deployment.

    @kt.compute(cpus=1, image=kt.images.pytorch())
    @kt.distribute("pytorch", workers=2)
    def step(x): ...

The decorators stack in either order. ``ktlite deploy script.py`` deploys every marked object
of the script. Afterwards, in any other process that imports the script, calling ``step(3)``
calls the deployed service by its name (no redeploy; if nothing is deployed the error says to
run ``ktlite deploy``). Run as the main script (``python script.py``), the first call deploys,
as ``kt.fn(step).to(...)`` would.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

from ktlite.api.compute import Compute
from ktlite.errors import ConfigError, NotDeployedError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.naming import check_naming
from ktlite.specs.spec import check_name, default_name


class Decorated:
    """A function or class marked with ``@kt.compute`` and/or ``@kt.distribute``."""

    def __init__(self, obj: Any) -> None:
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            raise ConfigError(
                f"@kt.compute / @kt.distribute decorate functions and classes, not "
                f"{type(obj).__name__}"
            )
        self.obj = obj
        self.is_class = inspect.isclass(obj)
        self.compute_kwargs: dict[str, Any] | None = None
        self.distribute_kwargs: dict[str, Any] | None = None
        self.autoscale_kwargs: dict[str, Any] | None = None
        self.name = default_name(obj.__name__)
        self.get_if_exists = False  # Kubetorch's: the first call attaches to a running deployment
        self.async_ = False  # @kt.async_: calls return a kt.Future (awaitable)
        self._remote: Any = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, obj, updated=())

    def __repr__(self) -> str:
        return f"<kt.{'cls' if self.is_class else 'fn'} {self.obj.__qualname__} as {self.name!r}>"

    @property
    def compute(self) -> Compute:
        """The Compute these decorators describe (``Compute()`` if only distributed)."""
        compute = Compute(**(self.compute_kwargs or {}))
        if self.distribute_kwargs is not None:
            compute = compute.distribute(**self.distribute_kwargs)
        if self.autoscale_kwargs is not None:
            compute = compute.autoscale(**self.autoscale_kwargs)
        return compute

    def _source(self) -> Any:
        # loaded at first use, not at `import ktlite` (which imports this module): the
        # deploying side (the client, httpx) is not for processes that only mark functions
        from ktlite.api.remote import cls, fn

        return cls(self.obj, self.name) if self.is_class else fn(self.obj, self.name)

    def deploy(self, *, detached: bool = False, dryrun: bool = False, init_args: Any = None) -> Any:
        """Deploy now; returns the remote object (or the Plan with ``dryrun=True``)."""
        source = self._source()
        if self.is_class:
            remote = source.to(
                self.compute,
                detached=detached,
                dryrun=dryrun,
                init_args=init_args,
                get_if_exists=self.get_if_exists,
            )
        else:
            remote = source.to(
                self.compute, detached=detached, dryrun=dryrun, get_if_exists=self.get_if_exists
            )
        if not dryrun:
            remote.async_ = self.async_
        if not dryrun:
            self._remote = remote
        return remote

    def _attach(self) -> Any:
        from ktlite.api.remote import RemoteClass, RemoteFunction
        from ktlite.modes.deploy import attach  # at first use, as in _source

        compute = self.compute
        spec = DeploymentSpec(
            name=self.name, pod=compute.pod_spec(), kind="cls" if self.is_class else "fn"
        )
        try:
            dep = attach(spec)
        except NotDeployedError as e:
            where = inspect.getsourcefile(self.obj) or self.obj.__module__
            raise NotDeployedError(
                f"{self.name!r} is not deployed: run `ktlite deploy {where}` first "
                f"(or call it from `python {where}`, which deploys on first call)"
            ) from e
        source = self._source()
        remote = (
            RemoteClass(source, dep, None, compute=compute)
            if self.is_class
            else RemoteFunction(source, dep, compute=compute)
        )
        remote.async_ = self.async_
        return remote

    def remote(self, *init_args: Any, **init_kwargs: Any) -> Any:
        """The deployed service: deployed here if this is the main script, else found by name."""
        with self._lock:
            if self._remote is None:
                if self.obj.__module__ == "__main__":
                    if init_args and init_kwargs:
                        raise ConfigError(
                            f"{self.name}: pass the constructor's arguments either "
                            "by position or by keyword, not both"
                        )
                    self.deploy(init_args=init_args or init_kwargs or None)
                else:
                    if init_args or init_kwargs:
                        raise ConfigError(
                            f"{self.name!r} is deployed by `ktlite deploy` with its "
                            "class's default constructor; call it without arguments"
                        )
                    self._remote = self._attach()
            return self._remote

    def __getstate__(self) -> dict[str, Any]:
        # shipped inside another function's globals: the pods need the object, not our handles
        return {k: v for k, v in self.__dict__.items() if k not in ("_remote", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _remote=None, _lock=threading.Lock())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_class:
            return self.remote(*args, **kwargs)
        return self.remote()(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        """A decorated class is a handle on its service, as in Kubetorch:
        ``Model.predict(x)`` calls ``predict`` on the deployed instance(s)."""
        if attr.startswith("_") or not self.__dict__.get("is_class"):
            raise AttributeError(attr)
        member = inspect.getattr_static(self.obj, attr, None)
        if member is None or not callable(getattr(self.obj, attr, None)):
            raise AttributeError(f"{self.obj.__name__} has no method {attr!r}")
        return _ServiceMethod(self, attr)

    def teardown(self) -> None:
        remote, self._remote = self._remote, None
        if remote is None:
            remote = self._attach()
        remote.teardown()


class _ServiceMethod:
    """``DecoratedClass.method``: calls the deployed instance's method (deploying or
    attaching on first use, like calling the class)."""

    def __init__(self, owner: Decorated, name: str) -> None:
        self._owner, self._name = owner, name

    def __repr__(self) -> str:
        return f"<service method {self._owner.name}.{self._name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._owner.remote(), self._name)(*args, **kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._owner.remote(), self._name).submit(*args, **kwargs)


def _mark(obj: Any) -> Decorated:
    return obj if isinstance(obj, Decorated) else Decorated(obj)


def compute(
    *,
    name: str | None = None,
    get_if_exists: bool = False,
    reload_prefixes: list[str] | str | None = None,
    prefix_username: bool | None = None,
    **compute_kwargs: Any,
) -> Any:
    """Mark a function or class to run on ``kt.Compute(**compute_kwargs)``.

    Kubetorch's keywords: ``name`` is normalised like Kubetorch's (``"GNN_Inference"`` →
    ``"gnn-inference"``); ``get_if_exists=True`` makes the first call attach to a running
    deployment of that name instead of deploying. ktlite never prefixes names with a user
    name, so ``reload_prefixes`` and ``prefix_username=True`` are refused.

    Example:
        >>> @kt.compute(cpus=1, name="square")
        ... def square(x): return x * x
    """
    check_naming(reload_prefixes, prefix_username)
    Compute(**compute_kwargs)  # bad fields fail here, at import, naming the field
    if name is not None:
        name = check_name(name)

    def wrap(obj: Any) -> Decorated:
        marked = _mark(obj)
        if marked.compute_kwargs is not None:
            raise ConfigError(f"{marked.obj.__name__} has two @kt.compute decorators; keep one")
        marked.compute_kwargs = dict(compute_kwargs)
        marked.get_if_exists = bool(get_if_exists)
        if name is not None:
            marked.name = name
        marked.compute  # noqa: B018  (validates the combination with @kt.distribute)
        return marked

    return wrap


def distribute(
    framework: str | None = None,
    workers: int | None = None,
    num_proc: int | list[int] | str | None = None,
    port: int | None = None,
    quorum_timeout: float | None = None,
    worker_node_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Mark a function or class to run on ``workers`` pods × ``num_proc`` ranks; takes what
    :meth:`kt.Compute.distribute` takes (Kubetorch's keywords too).

    Example:
        >>> @kt.distribute("pytorch", workers=2, num_proc=2)
        ... def train(): ...
    """
    options = {
        "framework": framework,
        "workers": workers,
        "num_proc": num_proc,
        "port": port,
        "quorum_timeout": quorum_timeout,
        "worker_node_options": worker_node_options,
        **kwargs,
    }
    Compute().distribute(**options)  # bad values fail here

    def wrap(obj: Any) -> Decorated:
        marked = _mark(obj)
        if marked.distribute_kwargs is not None:
            raise ConfigError(f"{marked.obj.__name__} has two @kt.distribute decorators; keep one")
        marked.distribute_kwargs = options
        marked.compute  # noqa: B018
        return marked

    return wrap


def autoscale(**kwargs: Any) -> Any:
    """Mark a function or class to be served by replicas that scale with load; takes what
    :meth:`kt.Compute.autoscale` takes (Kubetorch's keywords). Cannot be stacked with
    ``@kt.distribute``.

    Example:
        >>> @kt.compute(cpus=1)
        ... @kt.autoscale(min_scale=1, max_scale=4, concurrency=2)
        ... class Model: ...
    """
    Compute().autoscale(**kwargs)  # bad values fail here

    def wrap(obj: Any) -> Decorated:
        marked = _mark(obj)
        if marked.autoscale_kwargs is not None:
            raise ConfigError(f"{marked.obj.__name__} has two @kt.autoscale decorators; keep one")
        marked.autoscale_kwargs = dict(kwargs)
        marked.compute  # noqa: B018  (a @kt.distribute on it fails here, naming both)
        return marked

    return wrap


def async_(obj: Any) -> Decorated:
    """``@kt.async_``: calls of the decorated function (or methods of the decorated class)
    return a :class:`kt.Future` at once, which can be awaited. Stacks with the others."""
    marked = _mark(obj)
    marked.async_ = True
    return marked
