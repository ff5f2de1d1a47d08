"""The data store's size cap: ``KTLITE_STORE_MAX_BYTES``, the bytes the whole store may hold.

(One value's own limit is ``KTLITE_STORE_MAX_BODY``, checked by the store server's gate.) An
upload is checked twice: before any of its body is read, against the size it declares
(``x-ktlite-length`` or Content-Length), and while it streams, against the bytes that arrived
(a chunked body may declare nothing, or lie). What the store holds is its values and the
uploads in progress, less the value an upload replaces (it goes when the new one is in). The server
keeps that total as it changes (:class:`Usage`) rather than walking the store at each upload.
An upload that goes over is refused (``StoreFull``: HTTP 507 from the store server, a
``DataStoreError`` in the client) and its staged bytes are removed: nothing partial is left.
Standard library only: the store server imports it.
"""

from __future__ import annotations

import threading
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


class Usage:
    """The bytes a store holds, kept as a running total: one walk of its values at the first
    upload, then what each write and removal changed (:meth:`add`), plus the bytes of the
    uploads in progress. A refusal is confirmed by a fresh walk first, so a total that drifted
    (a value changed behind the server's back) never refuses what fits."""

    def __init__(self, store: StoreDir) -> None:
        self.store = store
        self._total: int | None = None
        self.in_flight = 0
        self._lock = threading.Lock()

    def held(self, exact: bool = False) -> int:
        with self._lock:
            total = self._total
        if total is None or exact:
            total = self.store.used_by_values()  # outside the lock: it walks the store
            with self._lock:
                self._total = total
        return total + self.in_flight

    def add(self, delta: int) -> None:
        """A write or removal changed the values by ``delta`` bytes."""
        with self._lock:
            if self._total is not None:
                self._total = max(0, self._total + delta)

    def forget(self) -> None:
        """Walk again at the next upload (after a wipe)."""
        with self._lock:
            self._total = None

    def arriving(self, n: int) -> None:
        with self._lock:
            self.in_flight += n


class Cap:
    """One upload of ``key`` under ``limit`` bytes in all (None: no cap), counted into
    ``usage``; :meth:`close` when it is stored or refused."""

    def __init__(
        self,
        usage: Usage,
        key: str,
        limit: int | None,
        declared: int | None = None,
        replacing: int = 0,
    ) -> None:
        self.usage, self.key, self.limit, self.got = usage, key, limit, 0
        self.replacing = replacing  # the bytes of the value it replaces, freed when it is stored
        if declared is not None:
            self._check(declared, "")

    def _check(self, size: int, so_far: str) -> None:
        if self.limit is None:
            return
        # everything but this upload's own bytes and the value it replaces
        others = self.usage.held() - self.got - self.replacing
        if others + size <= self.limit:
            return
        others = self.usage.held(exact=True) - self.got - self.replacing
        if others + size > self.limit:
            raise StoreFull(
                f"the data store is full: storing {self.key!r} ({size} bytes{so_far}) on top "
                f"of the {others} bytes it holds would go over its cap of {self.limit} bytes "
                f"({ENV}); nothing of {self.key!r} was kept. Remove keys (`ktlite rm`), or "
                f"raise {ENV} where the store runs",
                self.key,
            )

    def add(self, n: int) -> None:
        """Count ``n`` more bytes that arrived; StoreFull once over the cap."""
        self.got += n
        self.usage.arriving(n)
        self._check(self.got, " so far")

    def close(self) -> None:
        self.usage.arriving(-self.got)
        self.got = 0

    def count(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.add(len(chunk))
            yield chunk
