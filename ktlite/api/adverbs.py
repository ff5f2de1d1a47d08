"""The call adverbs of a deployed handle: a call as it is (``remote(x)``), with options
(``remote.options(timeout=60)(x)``), submitted (``.submit``: a :class:`kt.Future`), per rank
(``.each``) and sharded (``.sharded``); and how Kubetorch's per-call keywords become options.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import fields
from typing import Any, Protocol

from ktlite.api.compute import SERIALIZATIONS
from ktlite.api.futures import Future
from ktlite.errors import ConfigError, SerializationError
from ktlite.modes.callpath import CallOptions
from ktlite.net.rankdata import per_rank


class Caller(Protocol):
    """A deployed handle (:class:`ktlite.api.handles.RemoteFunction`, ``RemoteClass``)."""

    def _invoke(
        self,
        method: str | None,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: CallOptions | None,
        submit: bool = False,
    ) -> Any: ...

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
    ) -> list[Any]: ...


# Kubetorch's call keywords, accepted as options only when the user's callable can't take them
_KT_CALL_KWARGS = ("stream_logs", "workers", "restart_procs")  # ranks= only through .options()
_OPTION_NAMES = tuple(f.name for f in fields(CallOptions))


def _options(kwargs: dict[str, Any]) -> CallOptions:
    unknown = sorted(set(kwargs) - set(_OPTION_NAMES))
    if unknown:
        raise ConfigError(
            f"unknown call option(s) {', '.join(unknown)}; allowed: {', '.join(_OPTION_NAMES)}"
        )
    timeout = kwargs.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ConfigError(
            f"timeout={timeout!r} must be a positive number of seconds (or None for no limit)"
        )
    return CallOptions(**kwargs)


def _takes(fn: Any, name: str) -> bool:
    if fn is None:  # reattached by name: the code is not here; Kubetorch's keywords are ours
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # unknown signature: never steal the user's keywords
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.VAR_POSITIONAL)
        for p in params
    )


def _check_serialization(value: Any) -> str:
    if value == "none":
        raise ConfigError(
            "serialization='none' (raw bytes) is not supported; use 'pickle' (any Python "
            "object, the default) or 'json'"
        )
    if value not in SERIALIZATIONS:
        raise ConfigError(
            f"serialization={value!r}; allowed: {', '.join(map(repr, SERIALIZATIONS))}"
        )
    return str(value)


def _json_only(value: Any, what: str) -> Any:
    """``value`` as JSON gives it back (tuples become lists); refused if it is not JSON."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise SerializationError(
            f"serialization='json': {what} are not JSON ({e}); pass JSON values "
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
                "and remote.status() what every rank is doing"
            )
    if (
        "stream_metrics" in kwargs
        and not _takes(target, "stream_metrics")
        and kwargs.pop("stream_metrics")
    ):
        raise NotImplementedError(
            "stream_metrics=True: ktlite streams no metrics during calls; "
            "remote.status() (or `ktlite status NAME --watch`) shows each rank's "
            "CPU, memory and GPU use"
        )


class RemoteMethod:
    def __init__(self, owner: Any, name: str, target: Any) -> None:
        self._owner = owner
        self._name = name
        self._target = target

    def __repr__(self) -> str:
        return f"<RemoteMethod {self._owner.name}.{self._name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._invoke(self._name, self._target, args, kwargs, None)

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """The method call as a :class:`kt.Future`, returned at once."""
        future: Future = self._owner._invoke(
            self._name, self._target, args, kwargs, None, submit=True
        )
        return future

    def each(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        """The method on every rank, rank r getting ``items[r]`` first (see RemoteFunction.each)."""
        return self._owner._invoke(self._name, self._target, (per_rank(items), *args), kwargs, None)

    def sharded(
        self,
        data: Any,
        *args: Any,
        layout: dict[str, int],
        in_sharded_axes: Any,
        replicate_on_axes: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        """The method with sharded data (see RemoteFunction.sharded)."""
        values: list[Any] = self._owner._sharded(
            self._name, self._target, data, layout, in_sharded_axes, replicate_on_axes, args, kwargs
        )
        return values

    def options(self, **options: Any) -> Bound:
        return Bound(self._owner, self._name, self._target, _options(options))


class Bound:
    """A call with options fixed: every keyword argument goes to the user's function."""

    def __init__(
        self, remote: Caller, method: str | None, target: Any, options: CallOptions
    ) -> None:
        self._remote, self._method, self._target, self._opts = remote, method, target, options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote._invoke(self._method, self._target, args, kwargs, self._opts)

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        future: Future = self._remote._invoke(
            self._method, self._target, args, kwargs, self._opts, submit=True
        )
        return future
