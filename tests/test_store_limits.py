"""The data store's server refuses from the request head, as the pod server does
(``tests/test_server_limits.py``): a request without the store token is answered 401, and one
declaring a body over the store's limit 413, before its body is read; then the connection is
closed, so a client streaming a large body is cut off instead of having it all read.

Each test sends a body far larger than the kernel's socket buffers and counts the bytes the
server took before it closed the connection (never a time).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_procs import stop

import ktlite as kt
from ktlite.errors import DataStoreError
from ktlite_wire.headers import ERROR_CODE_HEADER, LENGTH_HEADER, TOKEN_HEADER, bearer
from ktlite_wire.storedir import address_file

WAIT = 60.0  # the longest any one wait here may take before it fails the test
BODY = 512 << 20  # the body a client declares and streams
# what a cut-off client may get into the server before it notices: the kernel's socket
# buffers on both sides (tcp_rmem's autotuned maximum is 32 MiB) and what the server had read
CUT_OFF = 128 << 20


class Store:
    def __init__(self, url: str, port: int, token: str, root: Path) -> None:
        self.url, self.port, self.token, self.root = url, port, token, root

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=WAIT)


@contextlib.contextmanager
def store_server(tmp_path: Path, **env: str) -> Iterator[Store]:
    """``python -m ktlite_server`` in store mode (``KTLITE_STORE_ROOT``) on a free port."""
    token = secrets.token_hex(16)
    ready = tmp_path / f"ready-{secrets.token_hex(4)}.json"
    root = tmp_path / "pvc"
    full = {**os.environ, "KTLITE_STORE_ROOT": str(root), "KTLITE_TOKEN": token, **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktlite_server", "--host", "127.0.0.1", "--port", "0"]
        + ["--ready-file", str(ready)],
        env=full,
    )
    try:
        deadline = time.monotonic() + WAIT
        while not ready.exists():
            assert proc.poll() is None, f"the store server exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"no ready file from the store server in {WAIT}s"
            time.sleep(0.05)
        port = int(json.loads(ready.read_text())["port"])
        yield Store(f"http://127.0.0.1:{port}", port, token, root)
    finally:
        stop(proc)


def _answer(s: socket.socket, what: str) -> tuple[bytes, dict[str, str], bytes]:
    """One response from ``s`` (status line, headers, body by its content-length), read
    without waiting for the connection to close."""
    got = b""
    while b"\r\n\r\n" not in got:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(
                f"the store did not answer {what} from its head within {WAIT:g}s (got {got!r})"
            ) from None
        if not chunk:
            raise AssertionError(f"the store closed {what} without an answer (got {got!r})")
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status.encode(), headers, body


def _stream_body(s: socket.socket, size: int) -> int:
    """Send up to ``size`` bytes of body on ``s``; how many the server took before it closed
    the connection (all of them when it read the whole body)."""
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < size:
            sent += s.send(chunk[: size - sent])
    except (BrokenPipeError, ConnectionResetError):
        pass
    except TimeoutError:
        raise AssertionError(
            f"the store neither read nor refused a body for {WAIT:g}s ({sent} bytes taken)"
        ) from None
    return sent


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


LIMIT = 1 << 20  # KTLITE_STORE_MAX_BODY of the store these tests share


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with store_server(tmp_path_factory.mktemp("store"), KTLITE_STORE_MAX_BODY=str(LIMIT)) as s:
        yield s


def test_a_body_without_the_token_is_refused_from_the_head_and_not_read(store: Store) -> None:
    for token in (None, "wrong"):
        headers = {"content-length": str(BODY)}
        if token:
            headers[TOKEN_HEADER] = bearer(token)
        with store.connect() as s:
            s.sendall(_head("PUT", "/store/v1/key?key=big&kind=file", headers))
            status, answer, body = _answer(s, "a PUT without the token")
            assert status.startswith(b"HTTP/1.1 401 "), (status, body)
            assert answer.get(ERROR_CODE_HEADER) == "unauthorized", answer
            assert "missing or wrong store token" in json.loads(body)["detail"]
            taken = _stream_body(s, BODY)
        assert taken < CUT_OFF, f"the store took {taken >> 20} MiB of a refused body"
        assert answer.get("connection") == "close", answer
    assert not (store.root / "data" / "big").exists(), "nothing is stored"
    with store.connect() as s:  # the store still answers
        s.sendall(_head("GET", "/health", {"connection": "close"}))
        assert _answer(s, "GET /health")[0].startswith(b"HTTP/1.1 200 ")


def test_a_body_over_the_limit_is_refused_from_the_head_with_413(store: Store) -> None:
    limit = LIMIT
    auth = {TOKEN_HEADER: bearer(store.token)}
    declared = (
        {"content-length": str(BODY)},
        # a chunked upload (as the store client sends) names its length in its own header
        {"transfer-encoding": "chunked", LENGTH_HEADER: str(BODY)},
    )
    for length in declared:
        with store.connect() as s:
            s.sendall(_head("PUT", "/store/v1/key?key=big&kind=file", {**auth, **length}))
            status, answer, body = _answer(s, "a PUT over the limit")
            assert status.startswith(b"HTTP/1.1 413 "), (status, body)
            assert answer.get(ERROR_CODE_HEADER) == "too_large", answer
            detail = json.loads(body)["detail"]
            assert f"{BODY} bytes" in detail and "KTLITE_STORE_MAX_BODY" in detail, detail
            taken = _stream_body(s, BODY)
        assert taken < CUT_OFF, f"the store took {taken >> 20} MiB of a refused body"
    # an endpoint that takes no body refuses one over 64 KiB the same way
    with store.connect() as s:
        s.sendall(_head("GET", "/store/v1/ls", {**auth, "content-length": str(BODY)}))
        status, _, body = _answer(s, "a GET with a body")
        assert status.startswith(b"HTTP/1.1 413 ") and b"takes no body" in body, body
    # within the limit, a PUT is stored as before
    with store.connect() as s:
        value = b"v" * limit
        s.sendall(
            _head(
                "PUT",
                "/store/v1/key?key=ok&kind=file",
                {**auth, "content-length": str(len(value)), "connection": "close"},
            )
            + value
        )
        status, _, body = _answer(s, "a PUT within the limit")
        assert status.startswith(b"HTTP/1.1 200 "), body
        assert json.loads(body)["size"] == limit
    assert (store.root / "data" / "ok").read_bytes() == value


def test_the_store_client_names_the_limit(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as a rank on a Kubernetes pod: the store address its pod server was handed
    from ktlite_server.store import remember

    ips = tmp_path / "ktlite-pod-ips-0.json"
    monkeypatch.setenv("KTLITE_POD_IPS_FILE", str(ips))
    monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
    monkeypatch.setenv("KTLITE_NAMESPACE", "default")
    remember({"url": store.url, "token": store.token, "pod": "ktlite-store-0"}, str(ips))
    assert os.path.exists(address_file(str(ips)))
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 1000)
    kt.put("small", small)
    big = tmp_path / "big.bin"
    big.write_bytes(b"b" * (2 << 20))
    with pytest.raises(DataStoreError, match="KTLITE_STORE_MAX_BODY"):
        kt.put("big", big)
    assert "big" not in {e["name"] for e in kt.ls()}
    assert "small" in {e["name"] for e in kt.ls()}
