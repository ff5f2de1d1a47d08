"""The data store: ``kt.put``, ``kt.get``, ``kt.ls``, ``kt.rm``, shared by every deployment of
a namespace, from the caller's machine and from inside pods.

Where the values live:

- backend ``local``: the directory ``$KTLITE_HOME/store/<namespace or "default">`` (local
  pods are handed its home, so their ranks use the same directory);
- backend ``kubernetes``: the namespace's ``ktlite-store`` pod and its PVC, created by the
  first ``put`` (``ktlite.backends.kube_store``); inside a pod, at the address the client
  handed the pod when it pushed the deployment's code.

On Kubernetes a deployment's pods reach their own prefix and what ``store_access`` shares
(:mod:`ktlite.datastore.location`); objects are signed by their writer and checked before they
are unpickled (:mod:`ktlite.datastore.signing`); ``rm`` never deletes the root (:func:`wipe`
does).

What a value is: ``put(key, src)`` with ``src`` a ``str`` or ``os.PathLike`` stores that file
or directory (it must exist: a typo never becomes a stored string); any other ``src`` (or
``data=``, which also takes strings) is a Python object stored by value (cloudpickle, tensors
included). ``get(key)`` returns an object; for a file or directory it writes
``dest`` (default: the key's last segment in the current directory, as Kubetorch does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ktlite.datastore.location import handoff, in_pod, local_root, open_store
from ktlite.datastore.storedir import ROOT_REFUSED, check_key, missing
from ktlite.errors import ConfigError, DataStoreError
from ktlite.net.progress import Progress
from ktlite_wire import codec

__all__ = ["get", "handoff", "in_pod", "local_root", "ls", "put", "rm", "wipe"]

_MISSING: Any = object()


# ---- public API ----------------------------------------------------------------------------


def put(
    key: str,
    src: Any = _MISSING,
    *,
    data: Any = _MISSING,
    namespace: str | None = None,
    backend: str | None = None,
    locale: str = "store",
    force: bool = False,
    verbose: bool = False,
) -> None:
    """Store a file, a directory or a Python object under ``key``, replacing what was there.

    Args:
        key: a '/'-separated relative path, e.g. ``"datasets/mnist"``.
        src: a path (``str`` or ``os.PathLike``) to a file or directory, or any other Python
            object (a tensor, a dict...) to store by value.
        data: a Python object to store by value, strings included.
        namespace: the store's namespace (default: ``ktlite config``'s, else the
            kubeconfig context's on Kubernetes, "default" locally).
        backend: "local" or "kubernetes" (default: ``ktlite config``'s backend).
        locale, force, verbose: Kubetorch's; only ``locale="store"`` exists here, a put always
            replaces (``force``), and ``verbose`` changes nothing (big transfers show progress).

    Example:
        >>> kt.put("datasets/mnist", "./mnist")          # a directory
        >>> kt.put("runs/1/config", {"lr": 0.1})         # an object
    """
    key = check_key(key)
    if locale != "store":
        raise ConfigError(
            f"locale={locale!r}: ktlite's data store keeps every value in the store "
            "(locale='store'); Kubetorch's peer-to-peer locale='local' is not supported"
        )
    if (src is _MISSING) == (data is _MISSING):
        raise ConfigError(
            "kt.put(key, src) takes a path or an object as src, or data=<object>; "
            "give exactly one of them"
        )
    store = open_store(backend, namespace, create=True)
    try:
        if data is _MISSING and isinstance(src, (str, os.PathLike)):
            path = Path(src)
            if path.is_dir():
                store.put_dir(key, path)
            elif path.is_file():
                store.put_file(key, path)
            elif path.exists():
                raise ConfigError(f"src={str(src)!r} is neither a regular file nor a directory")
            else:
                raise ConfigError(
                    f"src={str(src)!r}: no such file or directory; to store a string "
                    "as a value, pass it as data="
                )
        else:
            payload = codec.dumps(src if data is _MISSING else data)
            store.put_object(key, [store.signer.block(key, payload), payload])
    finally:
        store.close()


def get(
    key: str,
    dest: str | os.PathLike[str] | None = None,
    *,
    namespace: str | None = None,
    backend: str | None = None,
    force: bool = False,
    verbose: bool = False,
) -> Any:
    """Fetch ``key``: a Python object is returned; a file or directory is written to ``dest``
    (default: the key's last segment in the current directory) and its path returned.

    A file goes into ``dest`` if that is an existing directory, else to ``dest`` itself. A
    directory becomes ``dest``, or is merged into it if it exists (files of the same name
    are replaced). Every file is written to a temporary name and renamed into place.
    ``force`` and ``verbose`` are Kubetorch's and change nothing (files are always replaced).
    """
    key = check_key(key)
    store = open_store(backend, namespace, create=False)
    name = key.rsplit("/", 1)[-1]
    target = Path(dest) if dest is not None else Path.cwd() / name

    def receive(entry: dict[str, Any], chunks: Iterator[bytes]) -> Any:
        kind = entry.get("type")
        if kind == "object":
            if dest is not None:
                raise ConfigError(
                    f"key {key!r} holds a Python object: call kt.get({key!r}) without "
                    "dest to get it back"
                )
            stored = bytearray(b"".join(chunks))
            return ("object", codec.loads(store.signer.verify(key, stored)))
        progress = Progress(f"get {key}", int(entry.get("size") or 0))
        chunks = progress.wrap(chunks)
        try:
            if kind == "dir":
                return ("path", _receive_dir(chunks, target))
            out = target / name if target.is_dir() else target
            return ("path", _receive_file(chunks, out))
        finally:
            progress.close()

    try:
        _, value = store.fetch(key, receive)
    finally:
        store.close()
    return value


def ls(
    prefix: str = "",
    *,
    recursive: bool = False,
    namespace: str | None = None,
    backend: str | None = None,
    key: str | None = None,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """The entries under ``prefix`` (``key`` is Kubetorch's name for it): each a dict with
    ``key``, ``name`` (directories end in '/'), ``type`` ("file", "dir" or "object"),
    ``size`` in bytes and ``is_directory``. With ``recursive``, every file and object below.
    An empty store (or none yet) lists nothing."""
    prefix = check_key(key if key is not None else prefix, what="prefix", allow_root=True)
    store = open_store(backend, namespace, create=False, absent_ok=True)
    if store is None:
        if prefix:
            raise missing(prefix, "(there is no store in this namespace yet)")
        return []
    try:
        return [{**e, "is_directory": e["type"] == "dir"} for e in store.ls(prefix, recursive)]
    finally:
        store.close()


def rm(
    key: str,
    recursive: bool = False,
    *,
    namespace: str | None = None,
    backend: str | None = None,
    verbose: bool = False,
) -> None:
    """Delete ``key``; a directory only with ``recursive=True``. Never the whole store
    (``""`` or ``"/"``): that is :func:`wipe`, a separate call."""
    if key in ("", "/"):
        raise ConfigError(ROOT_REFUSED)
    key = check_key(key)
    store = open_store(backend, namespace, create=False)
    try:
        store.remove(key, recursive)
    finally:
        store.close()


def wipe(*, namespace: str | None = None, backend: str | None = None) -> int:
    """Delete every key of the namespace's store (``ktlite store wipe``, which asks first);
    the number of top-level keys removed. Needs the store's full access (a deployment's pod
    never has it)."""
    store = open_store(backend, namespace, create=False, absent_ok=True)
    if store is None:
        return 0
    try:
        removed: int = store.wipe()
        return removed
    finally:
        store.close()


# ---- writing what arrives ----------------------------------------------------------------------


def _staging(near: Path) -> Path:
    near.parent.mkdir(parents=True, exist_ok=True)
    return near.parent / f".{near.name}.ktlite-{uuid.uuid4().hex[:8]}"


def _receive_file(chunks: Iterator[bytes], out: Path) -> Path:
    staged = _staging(out)
    try:
        with open(staged, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(staged, out)
    except BaseException:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise
    return out


def _receive_dir(chunks: Iterator[bytes], out: Path) -> Path:
    from ktlite.datastore.storedir import extract, open_reader

    if out.exists() and not out.is_dir():
        raise DataStoreError(f"dest {str(out)!r} is a file; a directory key needs a directory dest")
    staged = _staging(out)
    try:
        extract(open_reader(chunks), staged)
        if not out.exists():
            os.rename(staged, out)
        else:
            _merge(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def _merge(src: Path, dst: Path) -> None:
    for dirpath, _, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.replace(Path(dirpath) / name, dst / rel / name)
