"""The two kinds of store ``kt.put/get/ls/rm`` talk to, with one interface: a directory of this
machine (:class:`LocalStore`, the local backend's) and a store server (:class:`RemoteStore`, the
Kubernetes store pod's). Each carries the :class:`~ktlite.datastore.signing.Signer` whose keys
sign and check the objects it stores."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ktlite.datastore.signing import Signer
from ktlite.datastore.storedir import (
    CHUNK,
    StoreDir,
    StoreFault,
    missing,
    open_reader,
    tar_stream,
    translate,
)
from ktlite.net.progress import Progress
from ktlite_wire.storecap import Cap, Usage

Receive = Callable[[dict[str, Any], Iterator[bytes]], Any]


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


class LocalStore:
    """A store directory of this machine (the local backend's), used in this process."""

    def __init__(self, store: StoreDir, signer: Signer, cap: int | None = None) -> None:
        self.store = store
        self.signer = signer
        self.cap = cap  # KTLITE_STORE_MAX_BYTES, as the store server applies it

    def close(self) -> None:
        pass

    def _write(self, key: str, size: int, write: Callable[[Cap], Any]) -> None:
        try:
            old = self.store.entry(key) if self.cap is not None else None
            replacing = int(old["size"]) if old else 0
            room = Cap(Usage(self.store), key, self.cap, size, replacing)  # walks, if capped
            write(room)
        except StoreFault as e:  # over the cap while it streamed: the store removed its staging
            raise translate(e) from None

    def put_file(self, key: str, path: Path) -> None:
        size = path.stat().st_size
        progress = Progress(f"put {key}", size)
        try:
            self._write(
                key,
                size,
                lambda room: self.store.write(key, room.count(progress.wrap(_file_chunks(path)))),
            )
        finally:
            progress.close()

    def put_dir(self, key: str, path: Path) -> None:
        size, chunks = tar_stream(path)
        progress = Progress(f"put {key}", size)
        try:
            self._write(
                key,
                size,
                lambda room: self.store.write_tar(
                    key, open_reader(room.count(progress.wrap(chunks)))
                ),
            )
        finally:
            progress.close()

    def put_object(self, key: str, parts: list[bytes]) -> None:
        size = sum(len(p) for p in parts)
        self._write(key, size, lambda room: self.store.write(key, room.count(parts), kind="object"))

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

    def wipe(self) -> int:
        return self.store.wipe()


class RemoteStore:
    """A store server (the Kubernetes store pod), through its HTTP client."""

    def __init__(self, client: Any, signer: Signer) -> None:
        self.client = client
        self.signer = signer

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

    def put_object(self, key: str, parts: list[bytes]) -> None:
        self.client.upload(key, "object", sum(len(p) for p in parts), lambda: iter(parts))

    def fetch(self, key: str, receive: Receive) -> Any:
        return self.client.download(key, receive)

    def ls(self, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.client.ls(prefix, recursive)
        return entries

    def remove(self, key: str, recursive: bool) -> None:
        self.client.remove(key, recursive)

    def wipe(self) -> int:
        removed: int = self.client.wipe()
        return removed
