"""``ktlite put / get / ls / rm`` and ``ktlite store status / create / teardown``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from ktlite.backends.registry import backend_class, traits
from ktlite.commands.confirmation import confirm
from ktlite.datastore import location, store
from ktlite.errors import ConfigError
from ktlite.net.progress import _size

Command = Callable[[str, str, str, object], argparse.ArgumentParser]


def _put(args: argparse.Namespace) -> int:
    if args.value is not None:
        store.put(args.key, data=args.value, backend=args.backend, namespace=args.namespace)
    elif args.src is None:
        raise ConfigError("ktlite put KEY SRC: give a file or directory, or --value TEXT")
    else:
        store.put(args.key, args.src, backend=args.backend, namespace=args.namespace)
    print(f"{args.key}: stored")
    return 0


def _get(args: argparse.Namespace) -> int:
    entries = store.ls(args.key, backend=args.backend, namespace=args.namespace)
    if len(entries) == 1 and entries[0]["key"] == args.key and entries[0]["type"] == "object":
        value = store.get(args.key, backend=args.backend, namespace=args.namespace)
        try:
            print(json.dumps(value))
        except TypeError:
            print(repr(value))
        return 0
    path = store.get(args.key, args.dest, backend=args.backend, namespace=args.namespace)
    print(f"{args.key} -> {path}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    entries = store.ls(
        args.prefix, recursive=args.recursive, backend=args.backend, namespace=args.namespace
    )
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        name = e["key"] if args.recursive else e["name"]
        print(f"{e['type']:7} {_size(e['size']):>10}  {name}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    store.rm(args.key, recursive=args.recursive, backend=args.backend, namespace=args.namespace)
    print(f"{args.key}: removed")
    return 0


def _kube(args: argparse.Namespace) -> Any:
    name = location.backend_name(args.backend)
    if traits(name).store != "pod":
        return None
    from ktlite.backends.kube_store import KubeStore

    return KubeStore(backend_class(name).shared(args.namespace))


def _confirm(args: argparse.Namespace, what: str) -> int | None:
    """As ``ktlite teardown --all``: asked on a terminal, refused without one unless ``-y``."""
    return confirm(
        yes=args.yes,
        command=f"store teardown --volumes asks before it deletes {what} with all its data",
        question=f"delete {what} with all its data?",
    )


def _wipe(args: argparse.Namespace) -> int:
    """Every key of the store deleted, after asking as ``ktlite teardown --all`` does."""
    where = f"namespace {location.local_namespace(args.namespace)!r}"
    if _kube(args) is not None and args.namespace:
        where = f"namespace {args.namespace!r}"
    refused = confirm(
        yes=args.yes,
        command=f"store wipe asks before it deletes every key of the data store of {where}",
        question=f"delete every key of the data store of {where}?",
    )
    if refused is not None:
        return refused
    removed = store.wipe(backend=args.backend, namespace=args.namespace)
    print(f"data store of {where}: wiped ({removed} top-level key(s) removed)")
    return 0


def _store(args: argparse.Namespace) -> int:
    if args.action == "wipe":
        return _wipe(args)
    kube = _kube(args)
    if kube is None:
        root = store.local_root(args.namespace)
        if args.action == "teardown":
            if not args.volumes:
                print(
                    f"the local store is the directory {root}; `ktlite store teardown --volumes` "
                    "deletes it with its data"
                )
                return 1
            refused = _confirm(args, f"the local data store {root}")
            if refused is not None:
                return refused
            import shutil

            shutil.rmtree(root, ignore_errors=True)
            print(f"{root}: removed")
        else:
            print(f"local data store: {root}")
        return 0
    if args.action == "create":
        address = kube.ensure(
            timeout=location.timeout(),
            size=args.size,
            storage_class=args.storage_class,
            image=args.image,
        )
        print(
            f"data store ready: pod {address.pod} in namespace {address.namespace!r} at {address.peer_url}"
        )
    elif args.action == "status":
        address = kube.find()
        if address is None:
            state = "exists, not running" if kube.exists() else "none"
            print(f"data store in namespace {kube.api.namespace!r}: {state}")
            return 1
        print(
            f"data store: pod {address.pod} in namespace {address.namespace!r} at {address.peer_url} "
            f"(pods deployed before it moved there need .to() again)"
        )
    else:
        if args.volumes:
            refused = _confirm(args, f"the data store of namespace {kube.api.namespace!r}")
            if refused is not None:
                return refused
        found = kube.teardown(volumes=args.volumes)
        kept = (
            ""
            if args.volumes
            else " (its PersistentVolumeClaim and data are kept; --volumes deletes them)"
        )
        print(
            f"data store in namespace {kube.api.namespace!r}: {'torn down' + kept if found else 'not found'}"
        )
    return 0


def add_commands(command: Command, where: Callable[[argparse.ArgumentParser], None]) -> None:
    pt = command(
        "put",
        "store a file, a directory or a text value in the data store",
        "ktlite put datasets/mnist ./mnist   |   ktlite put runs/1/note --value hello",
        _put,
    )
    pt.add_argument("key")
    pt.add_argument("src", nargs="?", default=None, help="a file or directory")
    pt.add_argument("--value", default=None, help="store this text as a value instead of a path")
    where(pt)
    gt = command(
        "get",
        "fetch a key of the data store (a value is printed)",
        "ktlite get datasets/mnist ./mnist",
        _get,
    )
    gt.add_argument("key")
    gt.add_argument(
        "dest", nargs="?", default=None, help="where to write (default: the key's name here)"
    )
    where(gt)
    ls = command("ls", "list the data store's keys under a prefix", "ktlite ls datasets -r", _ls)
    ls.add_argument("prefix", nargs="?", default="")
    ls.add_argument("-r", "--recursive", action="store_true", help="every file and value below")
    ls.add_argument("--json", action="store_true")
    where(ls)
    rm = command("rm", "remove a key of the data store", "ktlite rm datasets/old -r", _rm)
    rm.add_argument("key")
    rm.add_argument(
        "-r", "--recursive", action="store_true", help="a directory and everything under it"
    )
    where(rm)
    st = command(
        "store",
        "the data store itself: status, create, teardown, wipe (delete every key)",
        "ktlite store status -n team   |   ktlite store wipe -y",
        _store,
    )
    st.add_argument("action", choices=["status", "create", "teardown", "wipe"])
    st.add_argument("--volumes", action="store_true", help="teardown: delete the stored data too")
    st.add_argument(
        "-y",
        "--yes",
        "-f",
        "--force",
        action="store_true",
        help="teardown --volumes, wipe: do not ask before deleting the data; without a terminal "
        "to ask "
        "on it is refused unless given (as `ktlite teardown --all -y`)",
    )
    st.add_argument("--size", default=None, help="create: the PVC's size (default 10Gi)")
    st.add_argument("--storage-class", default=None, help="create: the PVC's StorageClass")
    st.add_argument("--image", default=None, help="create: the server image")
    where(st)
