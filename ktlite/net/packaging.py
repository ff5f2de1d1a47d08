"""Shipping the caller's code without an image rebuild.

Functions and classes defined in ``__main__`` or a notebook are pickled by value
(cloudpickle does that). So are the caller's *local* modules — files next to the script,
the test suite, anything not installed in site-packages or the standard library — and
their source travels along, so ``import helpers`` inside the function works on the pod.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import site
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any, TypeAlias

import cloudpickle

from ktlite.errors import SerializationError
from ktlite_wire import codec, envelope, sourcelines

_SKIP = (
    "ktlite",
    "ktlite_server",
    "ktlite_wire",
    "cloudpickle",
    "_pytest",
    "pytest",
    "pluggy",
    "__main__",
    "__mp_main__",
    "IPython",
    "ipykernel",
)
_MAX_SOURCE = 2 << 20
_MAX_SOURCES = 32 << 20


def _installed_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(Exception):
        paths.update(site.getsitepackages())
    with contextlib.suppress(Exception):
        paths.add(site.getusersitepackages())
    paths.update({sys.prefix, sys.base_prefix, sys.exec_prefix})
    return tuple(sorted(os.path.abspath(p) + os.sep for p in paths if p))


class _LocalModules:
    """The caller's local modules, recomputed only when ``sys.modules`` grows or shrinks."""

    def __init__(self) -> None:
        self._roots = _installed_roots()
        self._seen: tuple[int, str | None] = (-1, None)
        self._names: list[str] = []

    def names(self) -> list[str]:
        # the count and the newest name: a module removed and another imported changes the
        # newest name even when the count stays the same
        seen = (len(sys.modules), next(reversed(sys.modules), None))
        if seen != self._seen:
            self._seen = seen
            self._names = sorted(n for n, m in list(sys.modules.items()) if self._is_local(n, m))
        return self._names

    def _is_local(self, name: str, module: Any) -> bool:
        if name.split(".")[0] in _SKIP or module is None:
            return False
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            return False
        return not os.path.abspath(path).startswith(self._roots)


_local = _LocalModules()


@contextlib.contextmanager
def by_value() -> Iterator[None]:
    """Pickle the caller's local modules by value inside this block."""
    registered = []
    for name in _local.names():
        module = sys.modules.get(name)
        if module is None or "." in name:
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except ValueError:
            pass  # already registered
    try:
        yield
    finally:
        for module in registered:
            with contextlib.suppress(ValueError):
                cloudpickle.unregister_pickle_by_value(module)


def local_sources() -> dict[str, tuple[str, str, bool]]:
    """name -> (filename, source, is_package) for the caller's local modules."""
    out: dict[str, tuple[str, str, bool]] = {}
    total = 0
    for name in _local.names():
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path:
            continue
        try:
            if os.path.getsize(path) > _MAX_SOURCE:
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        if total > _MAX_SOURCES:
            break
        out[name] = (path, text, hasattr(module, "__path__"))
    return out


def bundle(obj: Any) -> bytes:
    """Pickle a function or class for shipping, with the source lines of the code it ships
    by value (remote tracebacks show them); names the culprit when that fails."""
    sourcelines.forget_stale()  # a deploy ships the files as they are now
    try:
        with by_value():
            out = io.BytesIO()
            sourcelines.Pickler(out, protocol=5).dump(obj)
            return out.getvalue()
    except Exception as e:
        raise SerializationError(_diagnose_callable(obj, e)) from e


# what a call names: the method (None: the function), or (target, method) on a colocated host
CallName: TypeAlias = "str | tuple[str | None, str | None] | None"


def encode_call(method: CallName, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Encode a call's arguments; names the argument that cannot be pickled."""
    try:
        with by_value():
            return codec.dumps_parts((method, args, kwargs), sources=True)
    except Exception as e:
        raise SerializationError(_diagnose_args(args, kwargs, e)) from e


# what a call's arguments may be made of and still skip cloudpickle: no code, no marker, no
# buffer (a bytearray would go out of band), each type exactly (a subclass may reduce to code)
_ATOMS = frozenset((type(None), bool, int, float, str, bytes))


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is builtin atoms, in small tuples, lists and dicts with string keys
    two levels deep at most (the arguments, and a container in them; a few steps to check)."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if kind not in (tuple, list, dict) or depth > 1 or len(value) > 16:
        return False
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return all(_plain(v, depth + 1) for v in value)


def encode_ranked_call(
    method: CallName, args: tuple[Any, ...], kwargs: dict[str, Any], world: int
) -> tuple[list[Any], dict[str, Any] | None]:
    """Encode a call whose arguments may hold ``kt.per_rank`` markers: the shared message,
    then one message per rank with that rank's items, and the offsets (None: no marker).
    Arguments of builtin types alone (the usual small call) are pickled by the C pickler,
    without cloudpickle and the caller's modules registered by value (a few microseconds
    where that took tens)."""
    if _plain(method) and _plain(args) and _plain(kwargs):
        return codec.dumps_plain((method, args, kwargs)), None
    from ktlite.net import rankdata

    args, kwargs, items = rankdata.split(args, kwargs, world)
    shared = encode_call(method, args, kwargs)
    if items is None:
        return shared, None
    pos = envelope.parts_size(shared)
    layout: dict[str, Any] = {"shared": pos, "items": [], "base": 0}
    parts = list(shared)
    for r, values in enumerate(items):
        try:
            with by_value():
                blob = codec.dumps_parts(values, sources=True)
        except Exception as e:
            raise SerializationError(
                f"the per-rank item(s) of rank {r} cannot be pickled: {type(e).__name__}: {e}"
            ) from e
        size = envelope.parts_size(blob)
        layout["items"].append([pos, size])
        parts.extend(blob)
        pos += size
    return parts, layout


def encode_value(value: Any, what: str) -> bytes:
    try:
        with by_value():
            return codec.dumps(value, sources=True)
    except Exception as e:
        raise SerializationError(_diagnose_value(value, what, e)) from e


def _diagnose_value(value: Any, what: str, err: Exception) -> str:
    """Name the entry that fails: ``init_args['lock'] (a _thread.lock)``, or the whole value."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = [(f"{what}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        # (args, kwargs) as kt.cls(...).to(init_args=...) packs them
        if len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict):
            items = [(f"{what}[{i}]", v) for i, v in enumerate(value[0])]
            items += [(f"{what}[{k!r}]", v) for k, v in value[1].items()]
        else:
            items = [(f"{what}[{i}]", v) for i, v in enumerate(value)]
    for label, item in items:
        e = _fails(item)
        if e is not None:
            return (
                f"{label} (a {_describe(item)}) cannot be pickled: {e}; pass plain data, or "
                "create the object on the pod"
            )
    return f"{what} cannot be pickled: {err}"


def _fails(obj: Any) -> Exception | None:
    try:
        with by_value():
            cloudpickle.dumps(obj, protocol=5)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _diagnose_callable(obj: Any, err: Exception) -> str:
    name = getattr(obj, "__qualname__", repr(obj))
    funcs = (
        [obj]
        if inspect.isfunction(obj)
        else [v for v in vars(obj).values() if inspect.isfunction(v)]
        if inspect.isclass(obj)
        else []
    )
    for fn in funcs:
        try:
            cv = inspect.getclosurevars(fn)
        except (TypeError, ValueError):
            continue
        for scope, names in (("global", cv.globals), ("closure variable", cv.nonlocals)):
            for var, value in names.items():
                if inspect.ismodule(value):
                    continue
                e = _fails(value)
                if e is not None:
                    return (
                        f"{name} cannot be shipped: it uses {scope} {var!r} (a {_describe(value)}), "
                        f"which cannot be pickled ({e}); create it inside the function, or pass "
                        "something picklable instead"
                    )
    return f"{name} cannot be pickled: {err}"


def _diagnose_args(args: tuple[Any, ...], kwargs: dict[str, Any], err: Exception) -> str:
    for i, value in enumerate(args):
        e = _fails(value)
        if e is not None:
            return (
                f"positional argument {i} (a {_describe(value)}) cannot be pickled: {e}; "
                "pass plain data, arrays or tensors, or create the object on the pod"
            )
    for key, value in kwargs.items():
        e = _fails(value)
        if e is not None:
            return (
                f"keyword argument {key!r} (a {_describe(value)}) cannot be pickled: {e}; "
                "pass plain data, arrays or tensors, or create the object on the pod"
            )
    return f"the call's arguments cannot be pickled: {err}"
