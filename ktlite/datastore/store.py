"""The data store: ``kt.put``, ``kt.get``, ``kt.ls``, ``kt.rm``, shared by every deployment of
a namespace, from the caller's machine and from inside pods.

Where the values live:

- backend ``local``: the directory ``$KTLITE_HOME/store/<namespace or "default">`` (local
  pods are handed its home, so their ranks use the same directory);
- backend ``kubernetes``: the namespace's ``ktlite-store`` pod and its PVC, created by the
  first ``put`` (``ktlite.backends.kube_store``); inside a pod, at the address the client
  handed the pod when it pushed the deployment's code.

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ktlite import config
from ktlite.backends.registry import NAMES, backend_class, traits
from ktlite.config import private_home
from ktlite.datastore.storedir import CHUNK, StoreDir, check_key, missing, tar_stream
from ktlite.errors import ConfigError, DataStoreError
from ktlite.net.progress import Progress
from ktlite_wire import codec

_MISSING: Any = object()
Receive = Callable[[dict[str, Any], Iterator[bytes]], Any]


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
    store = _open(backend, namespace, create=True)
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
            store.put_object(key, codec.dumps(src if data is _MISSING else data))
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
    store = _open(backend, namespace, create=False)
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
            return ("object", codec.loads(bytearray(b"".join(chunks))))
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
    store = _open(backend, namespace, create=False, absent_ok=True)
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
    """Delete ``key``; a directory only with ``recursive=True``."""
    key = check_key(key, allow_root=recursive)
    store = _open(backend, namespace, create=False)
    try:
        store.remove(key, recursive)
    finally:
        store.close()


# ---- where the store is ----------------------------------------------------------------------


def _backend_name(backend: str | None) -> str:
    chosen = backend or config.get("backend") or "local"
    if chosen not in NAMES:
        raise ConfigError(f"backend={chosen!r} is not known; allowed: 'local', 'kubernetes'")
    return chosen


def _local_namespace(namespace: str | None) -> str:
    return (
        namespace
        or os.environ.get("KTLITE_STORE_NAMESPACE")
        or config.get("namespace")
        or "default"
    )


def local_root(namespace: str | None = None) -> Path:
    """The local backend's store directory (local pods are handed the caller's home as
    KTLITE_STORE_HOME, and the deployment's namespace as KTLITE_STORE_NAMESPACE)."""
    home = (
        Path(os.environ["KTLITE_STORE_HOME"])
        if os.environ.get("KTLITE_STORE_HOME")
        else config.home()
    )
    return home / "store" / _local_namespace(namespace)


def _open(backend: str | None, namespace: str | None, create: bool, absent_ok: bool = False) -> Any:
    name = _backend_name(backend)
    kind = traits(name).store
    if kind == "directory":
        if not os.environ.get("KTLITE_STORE_HOME"):
            private_home()
        root = local_root(namespace)
        return _Local(
            StoreDir(root, where=f"of namespace {_local_namespace(namespace)!r} ({root})")
        )
    if kind is None:
        raise DataStoreError(
            f"the data store is not available on the {name} backend; use backend='local' "
            "or 'kubernetes'"
        )
    if in_pod():
        return _Remote(pod_client(namespace))
    from ktlite.backends.kube_store import KubeStore
    from ktlite.datastore.store_client import StoreClient

    kube = KubeStore(backend_class(name).shared(namespace))
    address = kube.find()
    if address is None or not kube.answers(address):
        if create or kube.exists():  # to make, or made and not answering yet (being replaced)
            address = kube.ensure(timeout=_timeout())
        elif absent_ok:
            return None
        else:
            raise DataStoreError(
                f"there is no data store in namespace {kube.api.namespace!r} yet: kt.put creates it"
            )
    return _Remote(
        StoreClient(
            address.url,
            address.token,
            http=address.http,
            describe=f"the data store pod {address.pod} in namespace {address.namespace!r}",
            stale_hint="`ktlite store status` shows the store's state",
        )
    )


def _timeout() -> float:
    from ktlite.backends.kube_store import DEFAULT_TIMEOUT_S

    return float(os.environ.get("KTLITE_STORE_TIMEOUT") or DEFAULT_TIMEOUT_S)


def in_pod() -> bool:
    """Whether this process runs in a Kubernetes pod of a ktlite deployment (a rank)."""
    return (
        bool(os.environ.get("KTLITE_POD_IPS_FILE"))
        and traits(os.environ.get("KTLITE_BACKEND")).store == "pod"
    )


def address_file() -> Path:
    """Where the pod server keeps the store address the client handed it (next to the pod's
    peer list, which every rank knows)."""
    from ktlite.datastore.storedir import address_file as path_for

    return Path(path_for(os.environ["KTLITE_POD_IPS_FILE"]))


def pod_client(namespace: str | None) -> Any:
    """A client for the store, inside a pod, from the address handed to it at deploy time."""
    import json

    from ktlite.datastore.store_client import StoreClient

    ns = os.environ.get("KTLITE_NAMESPACE", "?")
    if namespace and namespace != ns:
        raise DataStoreError(
            f"inside a pod the data store is its own namespace's ({ns!r}), not {namespace!r}"
        )
    try:
        info = json.loads(address_file().read_text())
    except (OSError, ValueError):
        info = {"url": None}
    if not info.get("url"):
        raise DataStoreError(
            f"this pod knows of no data store: namespace {ns!r} had none when the deployment's code "
            "was pushed; create it from your machine (`ktlite store create`, or any kt.put there), "
            "then call .to() again to hand the pods its address"
        )
    return StoreClient(
        info["url"],
        info["token"],
        describe=f"the data store pod {info.get('pod')} at {info['url']}",
        stale_hint="if the store pod was replaced since this deployment's code was "
        "pushed, it has a new IP: call .to() again from your machine to hand the pods its "
        "current address (`ktlite store status` shows it)",
    )


def handoff(backend: Any) -> dict[str, Any] | None:
    """What ``Deployment.push`` sends each pod about the store (Kubernetes only), or None."""
    return backend.store_handoff()  # type: ignore[no-any-return]


# ---- the two kinds of store ----------------------------------------------------------------


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


class _Local:
    def __init__(self, store: StoreDir) -> None:
        self.store = store

    def close(self) -> None:
        pass

    def put_file(self, key: str, path: Path) -> None:
        progress = Progress(f"put {key}", path.stat().st_size)
        try:
            self.store.write(key, progress.wrap(_file_chunks(path)))
        finally:
            progress.close()

    def put_dir(self, key: str, path: Path) -> None:
        from ktlite.datastore.storedir import open_reader

        size, chunks = tar_stream(path)
        progress = Progress(f"put {key}", size)
        try:
            self.store.write_tar(key, open_reader(progress.wrap(chunks)))
        finally:
            progress.close()

    def put_object(self, key: str, data: bytes) -> None:
        self.store.write(key, [data], kind="object")

    def fetch(self, key: str, receive: Receive) -> Any:
        entry = self.store.entry(key)
        if entry is None:
            raise missing(key, self.store.where)
        if entry["type"] == "dir":
            _, chunks = self.store.tar(key)
            return receive(entry, chunks)
        f, entry = self.store.open(key)
        with f:
            return receive(entry, iter(lambda: f.read(CHUNK), b""))

    def ls(self, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        return self.store.ls(prefix, recursive)

    def remove(self, key: str, recursive: bool) -> None:
        self.store.remove(key, recursive)


class _Remote:
    def __init__(self, client: Any) -> None:
        self.client = client

    def close(self) -> None:
        self.client.close()

    def _upload(
        self, key: str, kind: str, size: int, chunks: Callable[[], Iterator[bytes]]
    ) -> None:
        progress = Progress(f"put {key}", size)

        def counted() -> Iterator[bytes]:
            progress.done = 0  # sent again from the start
            return progress.wrap(chunks())

        try:
            self.client.upload(key, kind, size, counted)
        finally:
            progress.close()

    def put_file(self, key: str, path: Path) -> None:
        self._upload(key, "file", path.stat().st_size, lambda: _file_chunks(path))

    def put_dir(self, key: str, path: Path) -> None:
        size, _ = tar_stream(path)
        self._upload(key, "dir", size, lambda: tar_stream(path)[1])

    def put_object(self, key: str, data: bytes) -> None:
        self.client.upload(key, "object", len(data), lambda: iter([data]))

    def fetch(self, key: str, receive: Receive) -> Any:
        return self.client.download(key, receive)

    def ls(self, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.client.ls(prefix, recursive)
        return entries

    def remove(self, key: str, recursive: bool) -> None:
        self.client.remove(key, recursive)


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
