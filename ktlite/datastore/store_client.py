"""The data store pod's HTTP client (the store's wire contract is in ``ktlite_server.store``).

Values stream both ways in chunks: files as they are, directories as tar streams. Uploads go
chunked (through the API server's pod proxy a chunked body cannot race Go's reverse proxy;
see ``ktlite.net.client``). Every operation is idempotent (a put overwrites), so one that a proxy
refused or cut is sent again, from the start, within :data:`RETRY_WINDOW_S`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ktlite.errors import AuthError, ConfigError, DataStoreError
from ktlite.logconfig import http_hook
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import ERROR_CODE_HEADER, LENGTH_HEADER, TOKEN_HEADER, bearer

logger = logging.getLogger(__name__)

PREFIX = "/store/v1"
RETRY_WINDOW_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # an old pod IP swallows packets: fail fast, say why
_PROXY = (502, 503, 504)


class _Retry(Exception):
    """A proxy could not reach the store pod, or the transfer broke: send it again."""


class StoreClient:
    """Talks to one store server at ``url`` (a pod proxy URL or ``http://IP:PORT``).

    ``describe`` names the store in errors; ``stale_hint`` is added when it cannot be reached.
    """

    def __init__(
        self,
        url: str,
        token: str,
        http: httpx.Client | None = None,
        describe: str = "",
        stale_hint: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._owns = http is None
        self.http = http or httpx.Client(
            timeout=httpx.Timeout(60.0, connect=CONNECT_TIMEOUT_S),
            event_hooks={"response": [http_hook(logger)]},
        )
        self.describe = describe or f"the data store at {self.url}"
        self.stale_hint = stale_hint

    def __repr__(self) -> str:
        return f"StoreClient(url={self.url!r}, token=<hidden>)"

    def close(self) -> None:
        if self._owns:
            self.http.close()

    def _headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: bearer(self._token)}

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(120.0, connect=CONNECT_TIMEOUT_S, write=300.0, pool=30.0)

    # ---- one request, sent again while a proxy refuses it -----------------------------------

    def _run(self, what: str, attempt: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + RETRY_WINDOW_S
        delay = 0.05
        while True:
            try:
                return attempt()
            except _Retry as e:
                error: BaseException = e
            except httpx.ConnectTimeout as e:
                raise DataStoreError(
                    f"{self.describe} did not answer {what} (no connection within "
                    f"{CONNECT_TIMEOUT_S:g}s)" + self._hint()
                ) from e
            except httpx.ReadTimeout as e:
                raise DataStoreError(
                    f"{self.describe} went silent during {what}" + self._hint()
                ) from e
            except httpx.TransportError as e:
                error = e
            if time.monotonic() > deadline:
                raise DataStoreError(
                    f"could not reach {self.describe} for {what} within "
                    f"{RETRY_WINDOW_S:g}s: {error}" + self._hint()
                ) from error
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _hint(self) -> str:
        return f"; {self.stale_hint}" if self.stale_hint else ""

    def _check(self, resp: httpx.Response, what: str, key: str | None) -> None:
        if resp.status_code < 400:
            return
        resp.read()
        text = resp.text
        if resp.status_code in _PROXY:
            raise _Retry(f"HTTP {resp.status_code}: {text[:200]}")
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if isinstance(body, dict) and body.get("kind") == "Status":  # the API server, not the pod
            if resp.status_code in (400, 404):  # no pod (yet), or it has no IP
                raise _Retry(str(body.get("message", text))[:300])
            raise DataStoreError(
                f"the Kubernetes API server refused {what}: {body.get('message', text)}"
            )
        detail = str(body.get("detail", text)) if isinstance(body, dict) else text
        code = ErrorCode.parse(resp.headers.get(ERROR_CODE_HEADER))
        if code is ErrorCode.UNAUTHORIZED or (code is None and resp.status_code == 401):
            raise AuthError(
                f"{self.describe} refused the store token (HTTP 401) for {what}; the store "
                "was probably re-created: call .to() again to hand the pods its new token (or "
                "its pod runs a ktlite from before scoped tokens: `ktlite store teardown` then "
                "`ktlite store create` restarts it, keeping its data and key)"
            )
        if not detail.strip():  # not the store's server (it always explains itself)
            raise DataStoreError(
                f"{self.describe} answered HTTP {resp.status_code} with no detail to "
                f"{what}; is the store server there?" + self._hint(),
                key=key,
            )
        if code is ErrorCode.BAD_REQUEST:
            raise ConfigError(detail)
        raise DataStoreError(detail, key=key)

    def _get_json(self, path: str, params: dict[str, Any], what: str, key: str | None) -> Any:
        def attempt() -> Any:
            resp = self.http.get(
                self.url + PREFIX + path,
                params=params,
                headers=self._headers(),
                timeout=self._timeout(),
            )
            self._check(resp, what, key)
            return resp.json()

        return self._run(what, attempt)

    # ---- operations ---------------------------------------------------------------------------

    def health(self, timeout: float = 3.0) -> bool:
        try:
            return self.http.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def stat(self, key: str) -> dict[str, Any]:
        entry: dict[str, Any] = self._get_json("/stat", {"key": key}, f"stat {key!r}", key)
        return entry

    def ls(self, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self._get_json(
            "/ls",
            {"prefix": prefix, "recursive": "1" if recursive else "0"},
            f"ls {prefix!r}",
            prefix,
        )
        return entries

    def remove(self, key: str, recursive: bool) -> None:
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            resp = self.http.delete(
                self.url + PREFIX + "/key",
                headers=self._headers(),
                params={"key": key, "recursive": "1" if recursive else "0"},
                timeout=self._timeout(),
            )
            if attempts > 1 and resp.headers.get(ERROR_CODE_HEADER) == ErrorCode.NOT_FOUND.value:
                return  # an earlier attempt may have removed it and lost the answer
            self._check(resp, f"rm {key!r}", key)

        self._run(f"rm {key!r}", attempt)

    def wipe(self) -> int:
        """Delete every key (the store's full token only); how many top-level keys went."""

        def attempt() -> int:
            resp = self.http.post(
                self.url + PREFIX + "/wipe", headers=self._headers(), timeout=self._timeout()
            )
            self._check(resp, "wipe", None)
            return int(resp.json()["removed"])

        removed: int = self._run("wipe", attempt)
        return removed

    def upload(
        self, key: str, kind: str, size: int, open_chunks: Callable[[], Iterator[bytes]]
    ) -> None:
        """Upload a value: ``kind`` "file", "object" or "dir" (a tar stream); ``open_chunks``
        starts its chunks from the beginning (it is called again for a retry)."""
        what = f"put {key!r}"

        def attempt() -> None:
            headers = {
                **self._headers(),
                LENGTH_HEADER: str(size),
                "content-type": "application/x-tar"
                if kind == "dir"
                else "application/octet-stream",
            }
            # a generator: httpx sends it chunked
            resp = self.http.put(
                self.url + PREFIX + "/key",
                params={"key": key, "kind": kind},
                content=_generator(open_chunks()),
                headers=headers,
                timeout=self._timeout(),
            )
            self._check(resp, what, key)

        self._run(what, attempt)

    def download(self, key: str, receive: Callable[[dict[str, Any], Iterator[bytes]], Any]) -> Any:
        """Stream a value: ``receive(entry, chunks)`` consumes it (a file's bytes, or a
        directory's tar stream) and may be called again if the stream breaks."""
        what = f"get {key!r}"

        def attempt() -> Any:
            with self.http.stream(
                "GET",
                self.url + PREFIX + "/key",
                params={"key": key},
                headers=self._headers(),
                timeout=self._timeout(),
            ) as resp:
                self._check(resp, what, key)
                entry = json.loads(resp.headers.get("x-ktlite-entry", "{}"))
                length = int(resp.headers.get("content-length", "-1"))
                counted = _Counted(resp.iter_raw(1 << 20))
                try:
                    result = receive(entry, iter(counted))
                except httpx.TransportError as e:
                    raise _Retry(f"the download broke: {e!r}") from e
                if length >= 0 and counted.n != length:
                    raise _Retry(f"the download ended after {counted.n} of {length} bytes")
                return result

        return self._run(what, attempt)


class _Counted:
    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.n = chunks, 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.n += len(chunk)
            yield chunk


def _generator(chunks: Iterator[bytes]) -> Iterator[bytes]:
    yield from chunks
