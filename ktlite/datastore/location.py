"""Where the data store is, for this process, and what a deployment's pods may reach of it.

- backend ``local``: the directory ``$KTLITE_HOME/store/<namespace>``; local pods are handed
  the caller's home, so their ranks use the same directory (and its signing key: they are
  processes of the same user, with the same access);
- backend ``kubernetes``: from the caller's machine, the namespace's store pod through the API
  server's proxy, with the store's master key (from its Secret); inside a pod, the address,
  scoped token and signing keys the client handed the pod when it pushed the deployment's
  code (:func:`handoff`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from ktlite import config
from ktlite.backends.registry import NAMES, backend_class, traits
from ktlite.config import private_home
from ktlite.datastore.signing import Signer
from ktlite.datastore.storedir import StoreDir
from ktlite.datastore.stores import LocalStore, RemoteStore
from ktlite.errors import ConfigError, DataStoreError
from ktlite_wire.storecap import max_bytes
from ktlite_wire.storescope import Grant, mint


def backend_name(backend: str | None) -> str:
    chosen = backend or config.get("backend") or "local"
    if chosen not in NAMES:
        raise ConfigError(f"backend={chosen!r} is not known; allowed: 'local', 'kubernetes'")
    return chosen


def local_namespace(namespace: str | None) -> str:
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
    return home / "store" / local_namespace(namespace)


def open_store(
    backend: str | None, namespace: str | None, create: bool, absent_ok: bool = False
) -> Any:
    """The store ``kt.put/get/ls/rm`` talk to, with the signing keys of this process: a
    :class:`~ktlite.datastore.stores.LocalStore` or a
    :class:`~ktlite.datastore.stores.RemoteStore`; None when there is none and ``absent_ok``."""
    name = backend_name(backend)
    kind = traits(name).store
    if kind == "directory":
        if not os.environ.get("KTLITE_STORE_HOME"):  # (a local pod's rank: the caller's home)
            private_home()
        root = local_root(namespace)
        store = StoreDir(root, where=f"of namespace {local_namespace(namespace)!r} ({root})")
        try:
            cap = max_bytes(os.environ)  # the same cap as the store server's
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return LocalStore(store, Signer.full(local_master(root)), cap)
    if kind is None:
        raise DataStoreError(
            f"the data store is not available on the {name} backend; use backend='local' "
            "or 'kubernetes'"
        )
    if in_pod():
        client, signer = pod_client(namespace)
        return RemoteStore(client, signer)
    from ktlite.backends.kube_store import KubeStore
    from ktlite.datastore.store_client import StoreClient

    kube = KubeStore(backend_class(name).shared(namespace))
    address = kube.find()
    if address is None or not kube.answers(address):
        if create or kube.exists():  # to make, or made and not answering yet (being replaced)
            address = kube.ensure(timeout=timeout())
        elif absent_ok:
            return None
        else:
            raise DataStoreError(
                f"there is no data store in namespace {kube.api.namespace!r} yet: kt.put creates it"
            )
    client = StoreClient(
        address.url,
        address.token,
        http=address.http,
        describe=f"the data store pod {address.pod} in namespace {address.namespace!r}",
        stale_hint="`ktlite store status` shows the store's state",
    )
    return RemoteStore(client, Signer.full(address.token))


def timeout() -> float:
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


def pod_client(namespace: str | None) -> tuple[Any, Signer]:
    """A client for the store, inside a pod, from the address handed to it at deploy time,
    and the signing keys of the deployment's prefixes that came with it."""
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
    client = StoreClient(
        info["url"],
        info["token"],
        describe=f"the data store pod {info.get('pod')} at {info['url']}",
        stale_hint="if the store pod was replaced since this deployment's code was "
        "pushed, it has a new IP: call .to() again from your machine to hand the pods its "
        "current address (`ktlite store status` shows it)",
    )
    name = str(info.get("name") or "this deployment")
    return client, Signer.from_handoff(name, info.get("keys") or {}, info.get("writes") or ())


def handoff(
    backend: Any, name: str, access: tuple[tuple[str, str], ...] = ()
) -> dict[str, Any] | None:
    """What ``Deployment.push`` sends the pods of deployment ``name`` about the store
    (Kubernetes only), or None: never the store's master key, but a token scoped to the
    deployment's own prefix ``name`` (read/write) and to the prefixes of ``access``
    (``Compute(store_access=...)``: ``(prefix, "read" | "write")`` pairs), and the signing keys of
    those prefixes (:mod:`ktlite.datastore.signing`)."""
    info: dict[str, Any] | None = backend.store_handoff()
    if not info or not info.get("url"):
        return info
    master = info.pop("token")
    grants = (Grant(name, write=True), *(Grant(p, write=m == "write") for p, m in access))
    return {
        **info,
        "token": mint(master, name, grants),
        "name": name,
        "keys": Signer.full(master).handed(g.prefix for g in grants),
        "writes": sorted({g.prefix for g in grants if g.write}),
    }


def local_master(root: Path) -> str:
    """The master key of the local store at ``root`` (its file ``signing.key``, mode 0600, made
    on first use): it signs the objects the local store holds."""
    path = root / "signing.key"
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    root.mkdir(parents=True, exist_ok=True)
    staged = root / f".signing.key.{secrets.token_hex(8)}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    try:
        os.link(staged, path)  # the first of two racing processes wins; both read its key
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    return path.read_text().strip()
