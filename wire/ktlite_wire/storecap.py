"""The data store's size cap: ``KTLITE_STORE_MAX_BYTES``, the bytes the whole store may hold.

(One value's own limit is ``KTLITE_STORE_MAX_BODY``, checked by the store server's gate.) An
upload is checked twice: before any of its body is read, against the size it declares
(``x-ktlite-length`` or Content-Length), and while it streams, against the bytes that arrived
(a chunked body may declare nothing, or lie). What the store holds is measured when the upload
starts: its values and the uploads in progress (``tmp/``); a value that replaces another counts
both while it arrives. An upload that goes over is refused (``StoreFull``: HTTP 507 from the
store server, a ``DataStoreError`` in the client) and its staged bytes are removed: nothing
partial is left. Standard library only: the store server imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from ktlite_wire.errors import ErrorCode
from ktlite_wire.storedir import StoreDir, StoreFault

ENV = "KTLITE_STORE_MAX_BYTES"


class StoreFull(StoreFault):
    """Storing a value would take the store over its cap."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message, key, ErrorCode.STORE_FULL)


def max_bytes(environ: Mapping[str, str]) -> int | None:
    """The cap ``KTLITE_STORE_MAX_BYTES`` sets (None: no cap), or a ValueError naming it."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV}={raw!r}: must be a positive whole number of bytes")
    return int(raw)


class Cap:
    """One upload of ``key`` into ``store`` under ``limit`` bytes (None: no cap)."""

    def __init__(
        self, store: StoreDir, key: str, limit: int | None, declared: int | None = None
    ) -> None:
        self.key, self.limit, self.got = key, limit, 0
        self.used = store.used() if limit is not None else 0
        if declared is not None:
            self._check(declared, "")

    def _check(self, size: int, so_far: str) -> None:
        if self.limit is not None and self.used + size > self.limit:
            raise StoreFull(
                f"the data store is full: storing {self.key!r} ({size} bytes{so_far}) on top "
                f"of the {self.used} bytes it holds would go over its cap of {self.limit} bytes "
                f"({ENV}); nothing of {self.key!r} was kept. Remove keys (`ktlite rm`), or "
                f"raise {ENV} where the store runs",
                self.key,
            )

    def add(self, n: int) -> None:
        """Count ``n`` more bytes that arrived; StoreFull once over the cap."""
        self.got += n
        self._check(self.got, " so far")

    def count(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.add(len(chunk))
            yield chunk
