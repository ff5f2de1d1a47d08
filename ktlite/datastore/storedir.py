"""The data store's directory as the client uses it (the local backend's store): the
format lives in ``ktlite_wire.storedir``; here its faults become ktlite's errors
(:class:`~ktlite.errors.DataStoreError`, and :class:`~ktlite.errors.ConfigError` for a bad key).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ktlite.errors import ConfigError, DataStoreError
from ktlite_wire import storedir as _wire
from ktlite_wire.errors import ErrorCode
from ktlite_wire.storedir import (
    CHUNK,
    KINDS,
    MAX_KEY,
    OBJECT_MAGIC,
    ROOT_REFUSED,
    ChunkReader,
    StoreFault,
    address_file,
    missing_text,
    open_reader,
)

__all__ = [
    "CHUNK",
    "KINDS",
    "MAX_KEY",
    "OBJECT_MAGIC",
    "ROOT_REFUSED",
    "ChunkReader",
    "StoreDir",
    "StoreFault",
    "address_file",
    "check_key",
    "extract",
    "missing",
    "missing_text",
    "open_reader",
    "tar_stream",
    "translate",
]


def translate(e: StoreFault) -> Exception:
    """The ktlite error for a store fault."""
    if e.code is ErrorCode.BAD_REQUEST and e.key is None and isinstance(e, _wire.KeyRefused):
        return ConfigError(str(e))
    return DataStoreError(str(e), key=e.key)


def check_key(key: Any, *, what: str = "key", allow_root: bool = False) -> str:
    """``key`` normalised (one trailing '/' dropped), or a ConfigError naming what is wrong."""
    try:
        return _wire.check_key(key, what=what, allow_root=allow_root)
    except _wire.KeyRefused as e:
        raise ConfigError(str(e)) from None


def missing(key: str, where: str) -> DataStoreError:
    return DataStoreError(missing_text(key, where), key=key)


class StoreDir(_wire.StoreDir):
    """A data store kept in a directory, raising DataStoreError."""

    def fault(
        self, message: str, key: str | None = None, code: ErrorCode = ErrorCode.CONFLICT
    ) -> Exception:
        return DataStoreError(message, key=key)


def tar_stream(base: Path) -> tuple[int, Iterator[bytes]]:
    size, chunks = _wire.tar_stream(base)

    def translated() -> Iterator[bytes]:
        try:
            yield from chunks
        except StoreFault as e:
            raise translate(e) from e

    return size, translated()


def extract(stream: IO[bytes], dest: Path) -> int:
    try:
        return _wire.extract(stream, dest)
    except StoreFault as e:
        raise translate(e) from e
