"""Issue 24's hole, each attack against a real pod server on loopback (no token anywhere).

A bare ``python -m ktlite_server`` (no code deployed) with short limits set through its
``KTLITE_*`` variables, so a test waits a second where a pod waits fifteen: huge headers,
slowloris, idle connections, held connections under a low open-file limit, a body sent
without the token, and what ``/health`` tells a stranger. The last test is the issue's
acceptance test: a running call survives three clients sending huge headers and 200
slowloris connections, and ``/health`` stays answered.

No wall-clock assertions: every wait is bounded and says what it waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from server_procs import stop

import ktlite as kt
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.version import PROTOCOL_VERSION

WAIT = 60.0  # the longest any one wait here may take before it fails the test


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, token: str) -> None:
        self.proc, self.port, self.token = proc, port, token

    def connect(self, timeout: float = WAIT) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)


@contextlib.contextmanager
def pod_server(tmp_path: Path, nofile: int | None = None, **limits: str) -> Iterator[Server]:
    token = secrets.token_hex(16)
    ready = tmp_path / f"ready-{secrets.token_hex(4)}.json"
    env = {**os.environ, "KTLITE_TOKEN": token, **limits}

    def lower_fd_limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--procs",
            "0",
            "--ready-file",
            str(ready),
        ],
        env=env,
        preexec_fn=lower_fd_limit,
    )
    try:
        _wait_until(
            lambda: ready.exists() or proc.poll() is not None, "the pod server's ready file"
        )
        assert proc.poll() is None, f"the pod server exited with {proc.returncode}"
        yield Server(proc, int(json.loads(ready.read_text())["port"]), token)
    finally:
        stop(proc)


def _wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}; it did not happen")
        time.sleep(0.05)


def _read_until_closed(s: socket.socket, what: str, timeout: float = WAIT) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(
            f"the server kept {what} open for {timeout:g}s (it sent {got[:200]!r})"
        ) from None
    return got


def _get(
    server: Server, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    lines = [f"GET {path} HTTP/1.1", "host: x", "connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with server.connect() as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = _read_until_closed(s, f"GET {path}")
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _auth(token: str) -> dict[str, str]:
    return {
        TOKEN_HEADER: bearer(token),
        VERSION_HEADER: str(PROTOCOL_VERSION),
    }


def _send_header(server: Server, size: int) -> bytes:
    """Send a GET /health whose one header is ``size`` bytes; what the server answered."""
    with server.connect() as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            chunk = b"a" * (1 << 20)
            for _ in range(0, size, len(chunk)):
                s.sendall(chunk)
            s.sendall(b"\r\n\r\n")
        try:
            return _read_until_closed(s, "a connection with a huge header")
        except ConnectionResetError:
            return b""


def test_a_huge_header_is_refused_with_431(tmp_path) -> None:
    with pod_server(tmp_path) as server:
        answer = _send_header(server, 1 << 20)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
        assert b"KTLITE_MAX_HEADER_BYTES" in answer
        # the server stops reading at the limit: a client sending 32 MiB is cut off, not parsed
        cut = False
        with server.connect() as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * (32 << 20))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
        assert cut, "the server read a 32 MiB header in full"
        status, _ = _get(server, "/health")
        assert status == 200


def test_slowloris_connections_are_closed_after_the_header_timeout(tmp_path) -> None:
    with pod_server(tmp_path, KTLITE_HEADER_TIMEOUT="1") as server:
        socks = [server.connect() for _ in range(20)]
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nx-a: ")
        open_ = set(range(len(socks)))
        answers: dict[int, bytes] = {}
        deadline = time.monotonic() + WAIT
        while open_ and time.monotonic() < deadline:
            for i in list(open_):  # one byte each, every 0.2 s: never a complete head
                try:
                    socks[i].sendall(b"a")
                    socks[i].setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        data = socks[i].recv(65536)
                        answers[i] = answers.get(i, b"") + data
                        if not data:
                            open_.discard(i)
                    socks[i].setblocking(True)
                except OSError:
                    open_.discard(i)
            time.sleep(0.2)
        for s in socks:
            s.close()
        assert not open_, (
            f"{len(open_)} of {len(socks)} slowloris connections still open after {WAIT:g}s"
        )
        assert any(a.startswith(b"HTTP/1.1 408 ") for a in answers.values()), answers


def test_a_slow_head_after_a_request_on_the_same_connection_is_closed(tmp_path) -> None:
    """The header timer is not re-armed per request: a head that trickles in on a kept-alive
    connection, long after the timer was first armed, still gets its full timeout, then 408."""
    with (
        pod_server(tmp_path, KTLITE_HEADER_TIMEOUT="1", KTLITE_IDLE_TIMEOUT="30") as server,
        server.connect() as s,
    ):
        for _ in range(3):  # complete requests on one connection, across the first timeout
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, f"the server closed a kept-alive connection: {got[:200]!r}"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 "), got[:200]
            time.sleep(0.6)
        s.sendall(b"GET /health HTTP/1.1\r\nx-a: ")
        s.settimeout(0.2)
        answer = b""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:  # one byte every 0.2 s: never a complete head
            try:
                s.sendall(b"a")
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]


def test_idle_connections_are_closed(tmp_path) -> None:
    with pod_server(tmp_path, KTLITE_HEADER_TIMEOUT="1", KTLITE_IDLE_TIMEOUT="1") as server:
        with server.connect() as silent:  # connects and never sends a byte
            assert _read_until_closed(silent, "a connection that sent nothing").startswith(
                b"HTTP/1.1 408 "
            )
        with server.connect() as kept:  # one request, then idle on keep-alive
            kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = _read_until_closed(kept, "an idle keep-alive connection")
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        with (
            server.connect() as late
        ):  # answered before its body came (no code here), body sent after
            late.sendall(
                (
                    "POST /call HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                    f"{CALL_HEADER}: {json.dumps({'id': 'c1'})}\r\n"
                    + "".join(f"{k}: {v}\r\n" for k, v in _auth(server.token).items())
                    + "\r\n"
                ).encode()
            )
            first = late.recv(65536)
            assert first.startswith(b"HTTP/1.1 409 "), first[:300]
            late.sendall(b"body")
            _read_until_closed(late, "a connection idle after a body that came after its answer")


def test_held_connections_under_a_low_fd_limit_leave_room_for_health(tmp_path) -> None:
    """250 half-sent heads against a server whose open-file limit is 200: /health gets in."""
    with pod_server(tmp_path, nofile=200) as server:
        held = []
        try:
            for _ in range(250):
                s = server.connect()
                s.sendall(b"GET /health HTTP/1.1\r\nx-a: ")
                held.append(s)
            status, body = _get(server, "/health")
            assert status == 200 and body["status"] == "ok"
        finally:
            for s in held:
                s.close()


def test_a_full_server_answers_503_with_the_reason(tmp_path) -> None:
    """Every slot carries a request (an authenticated upload in progress): a new connection
    is told why it is refused; once one finishes, /health is answered again."""
    with pod_server(tmp_path, KTLITE_MAX_CONNECTIONS="8") as server:
        head = (
            "POST /deploy HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in _auth(server.token).items())
            + "\r\n"
        ).encode()
        busy = []
        try:
            for _ in range(8):
                s = server.connect()
                s.sendall(head + b"x" * 10)
                busy.append(s)
            with server.connect() as extra:
                answer = _read_until_closed(extra, "a connection past the cap")
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
            assert b"KTLITE_MAX_CONNECTIONS" in answer and b"8" in answer
        finally:
            for s in busy:
                s.close()
        _wait_until(lambda: _get(server, "/health")[0] == 200, "/health after the uploads ended")


def test_a_body_without_the_token_is_not_read(tmp_path) -> None:
    with pod_server(tmp_path) as server, server.connect() as s:
        s.sendall(b"POST /call HTTP/1.1\r\nhost: x\r\ncontent-length: 268435456\r\n\r\n")
        answer = _read_until_closed(s, "a connection whose 256 MiB body has no token")
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]


def test_health_without_the_token_tells_only_liveness_and_protocol(tmp_path) -> None:
    with pod_server(tmp_path) as server:
        status, body = _get(server, "/health")
        assert status == 200 and body == {"status": "ok", "protocol": PROTOCOL_VERSION}
        status, body = _get(server, "/health?ready=1")
        assert status == 503 and body == {
            "status": "not ready",
            "protocol": PROTOCOL_VERSION,
        }
        status, body = _get(server, "/health", _auth(server.token))
        assert status == 200 and {"python", "pod", "launch_id", "calls", "engine_failed"} <= set(
            body
        )
        status, body = _get(server, "/health?ready=1", _auth(server.token))
        assert status == 503 and "no launch loaded yet" in body["detail"]


def sleeper(seconds: float) -> int:
    time.sleep(seconds)
    return 42


def test_a_running_call_survives_huge_headers_and_slowloris(tmp_path) -> None:
    """The acceptance test of issue 24: three clients sending 96 MiB headers and 200
    slowloris connections while a call runs; /health stays answered, the call returns."""
    remote = kt.fn(sleeper, name="limits-survivor").to(kt.Compute(cpus=1))
    try:
        state = json.loads(
            (
                Path(os.environ["KTLITE_HOME"]) / "local" / "limits-survivor" / "state.json"
            ).read_text()
        )
        server = Server(None, int(state["pods"][0]["port"]), "")  # type: ignore[arg-type]
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = remote(4.0)
            except BaseException as e:  # noqa: BLE001 - reported below
                result["error"] = e

        call = threading.Thread(target=run)
        call.start()
        attackers = [
            threading.Thread(target=_send_header, args=(server, 96 << 20)) for _ in range(3)
        ]
        for t in attackers:
            t.start()
        loris = []
        try:
            for _ in range(200):
                s = server.connect()
                s.sendall(b"GET /health HTTP/1.1\r\nx-a: ")
                loris.append(s)
            while call.is_alive():  # /health answers all along the call
                status, body = _get(server, "/health")
                assert status == 200 and body["status"] == "ok"
                call.join(0.3)
        finally:
            for s in loris:
                s.close()
            for t in attackers:
                t.join(WAIT)
            call.join(WAIT)
        assert "error" not in result, f"the call failed under attack: {result.get('error')!r}"
        assert result["value"] == 42
    finally:
        remote.teardown()
