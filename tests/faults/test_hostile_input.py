"""Issue 4 point 8: auth and hostile input against a real pod server (no mocks).

One deployment (``hostile-srv``: 2 pods × 1 proc, started with a small ``KTLITE_MAX_BODY``)
is fuzzed with hypothesis: random and truncated bodies, wrong tokens, random call headers,
paths and methods, raw garbage and truncated uploads over sockets. Every answer must be a
4xx with a JSON ``detail`` (never a 5xx, never a hang: every client has a timeout), nothing
may run without the token, and afterwards the very same server processes still serve a real
call through the normal client. Tokens must never show up in pod logs, reprs, errors,
command lines or rank environments.

Constant-time comparison: ``app.authorize`` compares the whole header with
``hmac.compare_digest``; here every wrong token of the right length (each position changed)
is refused, which is what a byte-by-byte early exit would get wrong first.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hostile_mod as hm
import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ktlite as kt
from ktlite.backends.base import Applied, PodEndpoint
from ktlite.backends.local import LocalBackend
from ktlite.modes.deploy import Deployment
from ktlite.net import packaging
from ktlite.net.client import PodClient
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import DistributedConfig
from ktlite_wire import codec, envelope
from ktlite_wire import version as wire_version
from ktlite_wire.errors import ProtocolError
from ktlite_wire.frames import FRAME, RESULT, read_frames
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.launch import Launch
from ktlite_wire.outcome import CallResult
from ktlite_wire.plan import CallPlan
from ktlite_wire.version import PROTOCOL_VERSION

NAME = "hostile-srv"
PV = str(PROTOCOL_VERSION)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
ASCII = st.characters(min_codepoint=32, max_codepoint=126)
NOSPACE = st.characters(min_codepoint=33, max_codepoint=126)


def hostile_target(mode: str, arg: Any = None) -> Any:
    rank = int(os.environ["RANK"])
    if mode == "add":
        return arg + rank
    if mode == "touch":
        Path(str(arg)).write_text(f"ran on rank {rank}")
        return rank
    if mode == "env":
        print(f"rank {rank} env: {dict(os.environ)}", flush=True)
        return dict(os.environ)
    if mode == "raise":
        raise ValueError(f"hostile failure on purpose on rank {rank}")
    if mode == "sleep":
        time.sleep(float(arg))
        return rank
    raise AssertionError(mode)


def make_evil(marker: Path):
    def evil(*args: object) -> str:
        marker.write_text("evil code ran")
        return "evil"

    return evil


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limit() -> int:
    """A small body limit that still fits the deploy message (the caller's local sources)."""
    need = sum(len(src) for _file, src, _pkg in packaging.local_sources().values())
    return max(2 << 20, 2 * need + (1 << 20))


@pytest.fixture(scope="module")
def remote(limit):
    compute = kt.Compute(cpus=1, stream_logs=False, env={"KTLITE_MAX_BODY": str(limit)})
    r = kt.fn(hostile_target, name=NAME).to(compute.distribute("spmd", workers=2, num_proc=1))
    yield r
    r.teardown()


@pytest.fixture(scope="module")
def srv(remote) -> dict[str, Any]:
    state = hm.read_state(NAME)
    state["pids"] = [p["pid"] for p in state["pods"]]
    state["ports"] = [p["port"] for p in state["pods"]]
    state["dir"] = hm.local_dir(NAME)
    return state


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=httpx.Timeout(15.0, connect=5.0)) as client:
        yield client


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile-markers")


# ---- helpers ------------------------------------------------------------------------------------


def _auth(token: str, version: str | None = None) -> dict[str, str]:
    h = {TOKEN_HEADER: bearer(token)}
    if version is not None:
        h[VERSION_HEADER] = version
    return h


def _call_body(*args: Any) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in packaging.encode_call(None, args, {}))


def _call_meta(**extra: Any) -> str:
    return json.dumps({"id": uuid.uuid4().hex, "fanout": False, "stream_logs": False, **extra})


def _deploy_message(srv: dict[str, Any], marker: Path, ordinal: int = 0) -> bytes:
    return Launch(
        launch_id="intruder",
        bundle=packaging.bundle(make_evil(marker)),
        kind="fn",
        distributed=DistributedConfig(workers=2),
        pod_ips=["127.0.0.1", "127.0.0.1"],
        ordinal=ordinal,
        master_port=srv["master_port"],
        cpus=1.0,
        load_timeout=30.0,
    ).encode()


def _launch_ids(http: httpx.Client, srv: dict[str, Any]) -> list[str]:
    return [
        http.get(f"{u}/health", headers=_auth(srv["token"])).json()["launch_id"]
        for u in srv["urls"]
    ]


def _json_4xx(resp: httpx.Response, codes: tuple[int, ...] = (), what: str = "") -> Any:
    """A 4xx whose body is JSON with a non-empty ``detail``; returns the detail."""
    ctx = f"{what}: HTTP {resp.status_code} {resp.headers.get('content-type')} {resp.text[:300]!r}"
    assert 400 <= resp.status_code < 500, ctx
    if codes:
        assert resp.status_code in codes, ctx
    assert resp.headers.get("content-type", "").startswith("application/json"), ctx
    detail = resp.json().get("detail")
    assert detail, ctx
    return detail


def _assert_serving(remote, srv: dict[str, Any], http: httpx.Client) -> None:
    """The same server processes (none crashed, none restarted) still serve a real call."""
    for url in srv["urls"]:
        health = http.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert all(hm.alive(pid) for pid in srv["pids"]), "a pod server process died"
    assert [p["pid"] for p in hm.read_state(NAME)["pods"]] == srv["pids"]
    assert remote("add", 10) == [10, 11]
    assert all(not pod["active_calls"] for pod in remote.status())


def _raw(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes, half-close, and read until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(
                    f"the server neither answered nor closed within {timeout}s after {data[:80]!r}"
                ) from None
            if not chunk:
                break
            out += chunk
        return out


def _head(method: str, path: str, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _log_bytes(srv: dict[str, Any]) -> dict[Path, int]:
    return {p: p.stat().st_size for p in sorted(srv["dir"].glob("pod-*.log"))}


# ---- wrong tokens: 401, nothing runs ------------------------------------------------------------


def _wrong_token_headers(real: str) -> st.SearchStrategy[dict[str, str]]:
    n = len(real)
    same_length = st.tuples(st.integers(0, n - 1), NOSPACE).map(
        lambda t: real[: t[0]] + t[1] + real[t[0] + 1 :]
    )
    value = st.one_of(
        st.text(NOSPACE, max_size=80).map(lambda s: "Bearer " + s),
        st.text(ASCII, max_size=80).map(str.strip),
        same_length.map(lambda t: "Bearer " + t),
        st.integers(0, n - 1).map(lambda k: "Bearer " + real[:k]),
        st.text(NOSPACE, min_size=1, max_size=6).map(lambda s: "Bearer " + real + s),
        st.sampled_from(["bearer ", "BEARER ", "Basic ", "Token ", "", "Bearer  ", "Bearer:"]).map(
            lambda p: p + real
        ),
        st.just(real.swapcase()).map(lambda t: "Bearer " + t),
    )
    return st.one_of(
        value.map(str.strip).filter(lambda v: v != bearer(real)).map(lambda v: {TOKEN_HEADER: v}),
        st.just({}),
        st.just({"authorization": bearer(real)}),
        st.just({"x-ktlite-token-x": bearer(real)}),
    )


@pytest.mark.timeout(90)
def test_fuzz_wrong_tokens_get_401_and_run_nothing(remote, srv, http, marker_dir) -> None:
    token = srv["token"]
    marker = marker_dir / "wrong-token-ran"
    deploy_body = _deploy_message(srv, marker)
    call_body = _call_body("touch", str(marker))
    before = _launch_ids(http, srv)
    seen: list[int] = []

    @FUZZ
    @given(
        headers=_wrong_token_headers(token),
        pod=st.sampled_from([0, 1]),
        version=st.sampled_from([None, PV, "999"]),
    )
    def fuzz(headers: dict[str, str], pod: int, version: str | None) -> None:
        h = dict(headers)
        if version is not None:
            h[VERSION_HEADER] = version
        url = srv["urls"][pod]
        for resp in (
            http.get(f"{url}/status", headers=h),
            http.post(f"{url}/deploy", content=deploy_body, headers=h),
            http.post(f"{url}/call", content=call_body, headers={**h, CALL_HEADER: _call_meta()}),
            http.post(f"{url}/cancel/{uuid.uuid4().hex}", headers=h),
        ):
            _json_4xx(resp, (401,), f"headers {h}")
            _no_token(token, resp.text, "a 401 answer")
            seen.append(resp.status_code)

    fuzz()
    assert seen
    time.sleep(0.1)
    assert not marker.exists(), "a request without the right token ran code"
    assert _launch_ids(http, srv) == before, "a request without the right token replaced the code"
    _assert_serving(remote, srv, http)


def test_every_equal_length_wrong_token_is_refused(remote, srv, http, marker_dir) -> None:
    """Each position of the token changed in turn: all refused (compare_digest compares the
    whole value; an early-exit compare would be the first to get these wrong)."""
    token = srv["token"]
    marker = marker_dir / "equal-length-ran"
    body = _call_body("touch", str(marker))
    url = srv["urls"][0]
    for i, ch in enumerate(token):
        wrong = token[:i] + ("A" if ch != "A" else "B") + token[i + 1 :]
        assert len(wrong) == len(token) and wrong != token
        resp = http.post(
            f"{url}/call", content=body, headers={**_auth(wrong), CALL_HEADER: _call_meta()}
        )
        _json_4xx(resp, (401,), f"position {i}")
    assert not marker.exists()
    # the positive control: the real token runs it
    resp = http.post(
        f"{url}/call", content=body, headers={**_auth(token), CALL_HEADER: _call_meta()}
    )
    assert resp.status_code == 200 and marker.exists()


def test_unauthenticated_cancel_with_bad_query_is_401(srv, http) -> None:
    for headers in ({}, {TOKEN_HEADER: "Bearer wrong"}):
        resp = http.post(f"{srv['urls'][0]}/cancel/x", params={"reset": "xyz"}, headers=headers)
        _json_4xx(resp, (401,), "unauthenticated cancel with reset=xyz")


# ---- random and truncated bodies ----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_fuzz_deploy_bodies_are_4xx(remote, srv, http, marker_dir) -> None:
    marker = marker_dir / "deploy-fuzz-ran"
    message = _deploy_message(srv, marker)
    before = _launch_ids(http, srv)

    @FUZZ
    @given(data=st.data(), authed=st.booleans(), pod=st.sampled_from([0, 1]))
    def fuzz(data: st.DataObject, authed: bool, pod: int) -> None:
        body = data.draw(
            st.one_of(
                st.binary(max_size=4096),
                st.integers(0, len(message) - 1).map(lambda k: message[:k]),  # truncated
                st.binary(min_size=1, max_size=64).map(
                    lambda b: message[:16] + b
                ),  # valid head, junk
                st.binary(max_size=256).map(lambda b: codec.MAGIC + b),
                st.binary(max_size=256).map(lambda b: envelope.MAGIC + b),
            ),
            label="body",
        )
        headers = _auth(srv["token"]) if authed else {}
        resp = http.post(f"{srv['urls'][pod]}/deploy", content=body, headers=headers)
        detail = _json_4xx(resp, () if authed else (401,), f"deploy body {body[:40]!r}")
        if authed:
            assert resp.status_code == 400 and "malformed deploy request" in detail, detail

    fuzz()
    assert not marker.exists()
    assert _launch_ids(http, srv) == before
    _assert_serving(remote, srv, http)


def _json_values() -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(ASCII, max_size=20)
    return st.recursive(
        leaves,
        lambda c: (
            st.lists(c, max_size=4) | st.dictionaries(st.text(ASCII, max_size=8), c, max_size=4)
        ),
        max_leaves=12,
    )


@pytest.mark.timeout(90)
def test_fuzz_call_headers_are_4xx(remote, srv, http, marker_dir) -> None:
    """Invalid JSON, JSON that is not a call plan, huge values: 400 (401 without the token)."""
    marker = marker_dir / "call-header-fuzz-ran"
    body = _call_body("touch", str(marker))

    @FUZZ
    @given(
        header=st.one_of(
            st.text(ASCII, max_size=200).map(str.strip),
            _json_values()
            .filter(lambda v: not (isinstance(v, dict) and "id" in v))
            .map(json.dumps),
            # up to near the server's head limit (KTLITE_MAX_HEADER_BYTES, 256 KiB): past it, 431
            # (tests/test_server_limits.py)
            st.integers(1000, 200 << 10).map(lambda n: "x" * n),
            st.integers(1000, 200 << 10).map(lambda n: json.dumps({"pods": ["a" * n]})),
        ),
        authed=st.booleans(),
    )
    def fuzz(header: str, authed: bool) -> None:
        headers = {**(_auth(srv["token"]) if authed else {}), CALL_HEADER: header}
        resp = http.post(f"{srv['urls'][0]}/call", content=body, headers=headers)
        detail = _json_4xx(resp, (400,) if authed else (401,), f"call header {header[:60]!r}")
        if authed:
            assert CALL_HEADER in detail

    fuzz()
    assert not marker.exists()
    _assert_serving(remote, srv, http)


def _call_outcome_statuses(resp: httpx.Response) -> list[str]:
    frames = list(read_frames([resp.content]))
    assert frames and frames[-1][0] == RESULT, frames[-1:]
    return [o.status for o in CallResult.decode(frames[-1][1]).outcomes]


@pytest.mark.timeout(90)
def test_fuzz_call_bodies_fail_cleanly(remote, srv, http) -> None:
    """Random or truncated argument payloads: refused (4xx), or, as today, run into a rank that
    reports an error outcome. Never a 5xx, a hang, a crash of the server or a lost rank."""
    message = _call_body("add", 1)

    @FUZZ
    @given(
        body=st.one_of(
            st.binary(max_size=4096), st.integers(0, len(message) - 1).map(lambda k: message[:k])
        ),
        pod=st.sampled_from([0, 1]),
    )
    def fuzz(body: bytes, pod: int) -> None:
        resp = http.post(
            f"{srv['urls'][pod]}/call",
            content=body,
            headers={**_auth(srv["token"]), CALL_HEADER: _call_meta()},
        )
        if resp.status_code != 200:
            _json_4xx(resp, (400,), f"call body {body[:40]!r}")
            return
        assert _call_outcome_statuses(resp) == ["error"], body[:40]

    fuzz()
    _assert_serving(remote, srv, http)


def test_truncated_or_random_call_payload_is_4xx(remote, srv, http) -> None:
    message = _call_body("add", 1)
    for body in (b"", b"garbage", message[:10], message[:20], message[:-1]):
        resp = http.post(
            f"{srv['urls'][0]}/call",
            content=body,
            headers={**_auth(srv["token"]), CALL_HEADER: _call_meta()},
        )
        _json_4xx(resp, (400,), f"call body {body[:40]!r}")


@pytest.mark.timeout(60)
def test_call_plans_with_wrong_field_types_are_4xx(remote, srv, http) -> None:
    me = srv["urls"][0]
    cases = [
        {"id": ["x"]},
        {"id": {"a": 1}},
        {"fanout": True, "pods": [me], "timeout": "abc"},
        {"fanout": True, "pods": [me], "workers": "x"},
        {"fanout": True, "pods": [me], "workers": [5]},
        {"fanout": True, "pods": [1, 2], "quorum_timeout": 0.5},
        {"fanout": True, "pods": [me], "num_proc": -3},
        {"fanout": True, "pods": []},
    ]
    problems = []
    for case in cases:
        meta = {"id": uuid.uuid4().hex, "stream_logs": False, **case}
        resp = http.post(
            f"{me}/call",
            content=_call_body("add", 1),
            headers={**_auth(srv["token"]), CALL_HEADER: json.dumps(meta)},
        )
        if not 400 <= resp.status_code < 500:
            kinds = [k for k, _ in read_frames([resp.content])] if resp.status_code == 200 else []
            problems.append(f"{case}: HTTP {resp.status_code}, frames {kinds}")
    _assert_serving(remote, srv, http)
    assert not problems, "\n".join(problems)


def test_deeply_nested_call_header_is_4xx(remote, srv, http) -> None:
    for header in ("[" * 5000, ('{"id": ' * 5000).strip()):  # h11 refuses trailing spaces
        resp = http.post(
            f"{srv['urls'][0]}/call",
            content=b"",
            headers={**_auth(srv["token"]), CALL_HEADER: header},
        )
        _json_4xx(resp, (400,), f"nested header {header[:20]!r}")


# ---- paths, methods, raw garbage --------------------------------------------------------------

_PREFIXES = [
    "",
    "/",
    "/health",
    "/status",
    "/deploy",
    "/call",
    "/cancel",
    "/cancel/",
    "/docs",
    "/openapi.json",
    "/redoc",
    "/call/x",
    "//call",
    "/%63all",
    "/..",
]
_PATH_CHARS = st.sampled_from(list("abcxyz0189-_.~/%") + ["%2F", "%00", "%20", "%2e"])


def _protected(method: str, path: str) -> bool:
    p = unquote(path)
    if (method, p) in (("GET", "/status"), ("POST", "/deploy"), ("POST", "/call")):
        return True
    rest = p[len("/cancel/") :] if p.startswith("/cancel/") else ""
    return method == "POST" and bool(rest) and "/" not in rest


@pytest.mark.timeout(90)
def test_fuzz_paths_and_methods(remote, srv, http) -> None:
    base = srv["urls"][1]

    @FUZZ
    @given(
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        prefix=st.sampled_from(_PREFIXES),
        tail=st.lists(_PATH_CHARS, max_size=12).map("".join),
        authed=st.booleans(),
    )
    def fuzz(method: str, prefix: str, tail: str, authed: bool) -> None:
        path = prefix + tail
        assume(path.startswith("/"))
        try:
            url = httpx.URL(base + path)
        except httpx.InvalidURL:
            assume(False)
        headers = _auth(srv["token"]) if authed else {}
        resp = http.request(method, url, headers=headers)
        sent = resp.request.url.raw_path.decode().split("?")[0]
        ctx = f"{method} {sent} authed={authed}: HTTP {resp.status_code} {resp.text[:200]!r}"
        assert resp.status_code < 500, ctx
        _no_token(srv["token"], resp.text, ctx)
        if resp.status_code in (307, 308):  # FastAPI's trailing-slash redirect to a real route
            assert resp.headers["location"].rstrip("/"), ctx
        elif resp.status_code >= 400:
            _json_4xx(resp, what=ctx)
        else:
            assert authed or (method == "GET" and unquote(sent) == "/health"), ctx
        if _protected(method, sent) and not authed:
            assert resp.status_code == 401, ctx

    fuzz()
    _assert_serving(remote, srv, http)


@pytest.mark.timeout(90)
def test_fuzz_raw_garbage_over_a_socket(remote, srv, http) -> None:
    """Bytes that are not HTTP at all, or HTTP cut anywhere: answered with a 4xx or a closed
    connection, never a 5xx, and never left hanging once the client stops sending."""
    port = srv["ports"][0]
    good = (
        _head("POST", "/call", {**_auth(srv["token"]), CALL_HEADER: _call_meta()}, 40) + b"x" * 40
    )

    @settings(FUZZ, max_examples=150)
    @given(
        data=st.one_of(
            st.binary(max_size=512),
            st.integers(0, len(good) - 1).map(lambda k: good[:k]),
            st.binary(max_size=64).map(lambda b: b"GET /health HTTP/1.1\r\n" + b),
        )
    )
    def fuzz(data: bytes) -> None:
        answer = _raw(port, data, timeout=10.0)
        if answer:
            status = answer.split(b"\r\n", 1)[0]
            assert status.startswith(b"HTTP/1.1 ") and not status.startswith(b"HTTP/1.1 5"), (
                data[:80],
                answer[:200],
            )
        _no_token(srv["token"], answer, "a raw answer")

    fuzz()
    _assert_serving(remote, srv, http)


# ---- truncated, stalled and oversized uploads ---------------------------------------------------


@pytest.mark.timeout(90)
def test_truncated_and_stalled_uploads_do_not_wedge_the_server(remote, srv, http) -> None:
    port = srv["ports"][0]
    token = srv["token"]
    shm_before = hm.shm_files()
    # declared sizes below and above the in-memory limit (above it the server stages the body
    # in a /dev/shm file, which must go when the client does)
    for n in (5000, 3 << 20):
        for path, extra in (("/deploy", {}), ("/call", {CALL_HEADER: _call_meta()})):
            for sent in (0, 1, n // 2, n - 1):
                _raw(port, _head("POST", path, {**_auth(token), **extra}, n) + b"k" * sent)
    # a client that stalls mid-upload (connection open) does not hold up anybody else
    stalled = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        stalled.sendall(
            _head("POST", "/call", {**_auth(token), CALL_HEADER: _call_meta()}, 3 << 20)
            + b"s" * 1000
        )
        start = time.monotonic()
        _assert_serving(remote, srv, http)
        assert time.monotonic() - start < 10
    finally:
        stalled.close()
    _assert_serving(remote, srv, http)
    leaked = hm.wait_for(
        lambda: not {f for f in hm.shm_files() - shm_before if f.startswith("ktlite-arg-")},
        timeout=5.0,
    )
    assert leaked, f"upload staging files left in /dev/shm: {hm.shm_files() - shm_before}"


def test_truncated_call_upload_logs_no_unhandled_exception(remote, srv, http) -> None:
    before = _log_bytes(srv)
    port = srv["ports"][0]
    for n in (5000, 3 << 20):
        _raw(
            port,
            _head("POST", "/call", {**_auth(srv["token"]), CALL_HEADER: _call_meta()}, n)
            + b"k" * 100,
        )
    _assert_serving(remote, srv, http)
    time.sleep(0.2)
    for path, offset in before.items():
        with open(path, "rb") as f:
            f.seek(offset)
            new = f.read().decode(errors="replace")
        assert "Exception in ASGI application" not in new and "Traceback" not in new, new[-2000:]


@pytest.mark.timeout(60)
def test_oversized_bodies_get_413_and_the_server_keeps_serving(remote, srv, http, limit) -> None:
    url = srv["urls"][0]
    token = srv["token"]
    for path, extra in (("/deploy", {}), ("/call", {CALL_HEADER: _call_meta()})):
        for size in (limit + 1, 2 * limit):
            try:
                resp = http.post(
                    f"{url}{path}", content=b"\0" * size, headers={**_auth(token), **extra}
                )
            except httpx.TransportError:
                # the server answered before reading the body and closed while we still wrote:
                # look at its answer over a socket that sends only the head and a little
                answer = _raw(
                    srv["ports"][0], _head("POST", path, {**_auth(token), **extra}, size) + b"x"
                )
                assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
                continue
            detail = _json_4xx(resp, (413,), f"{path} with {size} bytes")
            assert str(size) in detail and str(limit) in detail and "KTLITE_MAX_BODY" in detail, (
                detail
            )
        # the limit itself is allowed (this body is garbage, so 400, or a rank error for /call)
        resp = http.post(
            f"{url}{path}",
            content=b"\0" * limit,
            headers={**_auth(token), **extra, **({CALL_HEADER: _call_meta()} if extra else {})},
        )
        assert resp.status_code in (200, 400), resp.text[:200]
        # without the token the size does not matter: 401, before anything is read
        resp = http.post(f"{url}{path}", content=b"\0" * (limit + 1), headers=extra)
        _json_4xx(resp, (401,), f"unauthenticated {path}")
    # a huge declared length is refused from the header alone, at once
    for path in ("/deploy", "/call"):
        start = time.monotonic()
        answer = _raw(
            srv["ports"][0],
            _head("POST", path, {**_auth(token), CALL_HEADER: _call_meta()}, 1 << 40) + b"abc",
            timeout=10,
        )
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - start < 5
    # no Content-Length (chunked upload): 411
    resp = http.post(f"{url}/deploy", content=iter([b"abc"]), headers=_auth(token))
    _json_4xx(resp, (411,), "chunked deploy")
    _assert_serving(remote, srv, http)


# ---- protocol version mismatch ------------------------------------------------------------------


def test_protocol_version_mismatch_is_409_naming_both(remote, srv, http, marker_dir) -> None:
    marker = marker_dir / "version-mismatch-ran"
    url = srv["urls"][0]
    token = srv["token"]
    before = _launch_ids(http, srv)
    for theirs in ("1", "999", "2.0", "abc"):
        h = _auth(token, theirs)
        for resp in (
            http.get(f"{url}/status", headers=h),
            http.post(f"{url}/deploy", content=_deploy_message(srv, marker), headers=h),
            http.post(
                f"{url}/call",
                content=_call_body("touch", str(marker)),
                headers={**h, CALL_HEADER: _call_meta()},
            ),
            http.post(f"{url}/cancel/x", headers=h),
        ):
            detail = _json_4xx(resp, (409,), f"version {theirs}")
            assert f"client speaks {theirs}" in detail and f"speaks {PV}" in detail, detail
            assert "protocol" in detail
    # the token is checked first: a wrong token with a wrong version is a 401
    resp = http.get(f"{url}/status", headers=_auth("nope", "999"))
    _json_4xx(resp, (401,))
    time.sleep(0.1)
    assert not marker.exists()
    assert _launch_ids(http, srv) == before
    _assert_serving(remote, srv, http)


def test_client_raises_protocol_mismatch_naming_both(remote, srv, http, monkeypatch) -> None:
    """The real client against the real server, with this client's constant changed."""
    with monkeypatch.context() as m:
        m.setattr(wire_version, "PROTOCOL_VERSION", 77)
        for attempt in (lambda: remote("add", 1), remote.status):
            with pytest.raises(kt.ProtocolMismatch) as info:
                attempt()
            text = str(info.value)
            assert "77" in text and PV in text, text
            _no_token(srv["token"], text, "the ProtocolMismatch")
    _assert_serving(remote, srv, http)


class _FakePod(BaseHTTPRequestHandler):
    """A 'pod' that speaks another protocol, or answers /call with a given raw stream."""

    protocol_version = "HTTP/1.1"
    health: dict[str, Any] = {}
    call_body = b""

    def log_message(self, *args: Any) -> None:  # keep the test output clean
        pass

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, "application/json", json.dumps(self.health).encode())

    def do_POST(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        self._send(200, "application/x-ktlite-frames", self.call_body)


@pytest.fixture
def fake_pod():
    handler = type("Handler", (_FakePod,), {"health": {}, "call_body": b""})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.timeout(30)
def test_client_refuses_a_pod_speaking_another_protocol(fake_pod) -> None:
    handler, url = fake_pod
    handler.health = {
        "status": "ok",
        "protocol": 99,
        "version": "9.9.9",
        "python": "",
        "pod": "fake-0",
        "ordinal": 0,
        "launch_id": None,
    }
    client = PodClient("fake-token-value")
    try:
        with pytest.raises(kt.ProtocolMismatch) as info:
            client.health(url)
    finally:
        client.close()
    text = str(info.value)
    assert "99" in text and PV in text and "9.9.9" in text, text
    # deploying onto it fails at once with the same error, not after launch_timeout
    spec = DeploymentSpec(name="hostile-fake", pod=kt.Compute(launch_timeout=20).pod_spec())
    applied = Applied(
        name="hostile-fake",
        backend="local",
        token="fake-token-value",
        master_port=1,
        endpoints=[PodEndpoint("hostile-fake-0", 0, url, url, "127.0.0.1")],
    )
    dep = Deployment(spec, LocalBackend.shared(), applied)
    start = time.monotonic()
    try:
        with pytest.raises(kt.ProtocolMismatch) as info:
            dep.push(packaging.bundle(hostile_target), {}, None)
    finally:
        dep.close()
    assert time.monotonic() - start < 5
    assert "99" in str(info.value) and PV in str(info.value)
    assert "fake-token-value" not in str(info.value)


@pytest.mark.timeout(30)
def test_client_survives_a_frame_with_an_absurd_length(fake_pod) -> None:
    handler, url = fake_pod
    client = PodClient("fake-token-value")
    problems = []
    try:
        for length in ((1 << 64) - 1, 1 << 50):
            handler.call_body = FRAME.pack(RESULT, length) + b"abc"
            try:
                client.call(url, CallPlan(id="x"), [b""], None)
            except (kt.PodUnreachable, ProtocolError):
                continue
            except BaseException as e:  # noqa: BLE001
                problems.append(f"length {length}: {type(e).__name__}: {e}")
            else:
                problems.append(f"length {length}: returned a result")
    finally:
        client.close()
    assert not problems, problems


# ---- the token never leaks ---------------------------------------------------------------------


def _no_token(token: str | bytes, text: str | bytes, where: str) -> None:
    """Fail naming where the token showed up, without printing the token or the text."""
    tok = token.encode() if isinstance(token, str) else token
    leaked = tok in (text.encode() if isinstance(text, str) else text)
    assert not leaked, f"the token appears in {where}"


def _error_text(err: BaseException) -> str:
    parts = [
        str(err),
        repr(err),
        "\n".join(getattr(err, "__notes__", []) or []),
        "".join(traceback.format_exception(err)),
    ]
    for f in getattr(err, "failures", []) or []:
        parts += [repr(f), f.describe()]
    return "\n".join(parts)


@pytest.mark.timeout(60)
def test_token_not_in_reprs_or_errors(remote, srv, http, monkeypatch) -> None:
    token = srv["token"]
    dep = remote.deployment
    texts = [
        repr(remote),
        str(remote),
        repr(dep),
        str(dep),
        repr(vars(dep)),
        repr(dep.applied),
        str(dep.applied),
        repr(dep.client),
        str(dep.client),
        repr(dep.spec),
        repr(remote.compute),
        json.dumps(remote.status()),
        repr(kt.fn(hostile_target, name=NAME)),
        str(kt.fn(hostile_target, name=NAME).to(remote.compute, dryrun=True)),
    ]
    errors: list[BaseException] = []
    with pytest.raises(ValueError) as raised:
        remote("raise")
    errors.append(raised.value)
    bad = PodClient(token[::-1])  # a wrong token: the AuthError must not echo it either
    try:
        with pytest.raises(kt.AuthError) as auth:
            bad.status(srv["urls"][0])
    finally:
        bad.close()
    errors.append(auth.value)
    _no_token(token[::-1], _error_text(auth.value), "the AuthError of a wrong token")
    with socket.socket() as s:  # a port nobody listens on: PodUnreachable, with the real token
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    good = PodClient(token)
    try:
        with pytest.raises(kt.PodUnreachable) as unreachable:
            good.status(dead)
        with pytest.raises(kt.PodUnreachable) as unreachable_call:
            good.call(dead, CallPlan(id="x"), [b""], None)
    finally:
        good.close()
    errors += [unreachable.value, unreachable_call.value]
    with monkeypatch.context() as m:
        m.setattr(wire_version, "PROTOCOL_VERSION", 77)
        with pytest.raises(kt.ProtocolMismatch) as mismatch:
            remote("add", 1)
    errors.append(mismatch.value)
    with pytest.raises(kt.SerializationError) as ser:
        remote("add", threading.Lock())
    errors.append(ser.value)
    with pytest.raises(kt.CallTimeout) as timeout:
        remote.options(timeout=0.3)("sleep", 30)
    errors.append(timeout.value)
    texts += [_error_text(e) for e in errors]
    for i, text in enumerate(texts):
        _no_token(token, text, f"text #{i}: {text[:80]!r}...")
    _assert_serving(remote, srv, http)


def _rank_pids(remote) -> list[int]:
    return [r["pid"] for pod in remote.status() for r in pod["ranks"] if r["pid"]]


@pytest.mark.timeout(60)
def test_token_not_in_command_lines_or_rank_environments(remote, srv) -> None:
    token = srv["token"]
    envs = remote("env")
    assert len(envs) == 2
    for env in envs:
        assert "KTLITE_TOKEN" not in env
        _no_token(token, "\n".join(env.values()), "a rank's os.environ")
    ranks = _rank_pids(remote)
    assert len(ranks) == 2
    for pid in srv["pids"] + ranks:
        _no_token(token, Path(f"/proc/{pid}/cmdline").read_bytes(), f"/proc/{pid}/cmdline")
    for pid in ranks:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        _no_token(token, environ, f"/proc/{pid}/environ (a rank process)")
        assert b"KTLITE_TOKEN" not in [e.split(b"=", 1)[0] for e in environ.split(b"\0")]


def test_token_not_in_pod_server_environment(srv) -> None:
    for pid in srv["pids"]:
        _no_token(
            srv["token"],
            Path(f"/proc/{pid}/environ").read_bytes(),
            f"/proc/{pid}/environ (a pod server)",
        )


@pytest.mark.timeout(60)
def test_token_not_in_pod_logs(remote, srv, http) -> None:
    """After auth failures, near-miss tokens, a version clash, a failing call, ranks printing
    their whole environment and a broken upload, no file the pods write holds the token."""
    token = srv["token"]
    url = srv["urls"][0]
    for h in (_auth(token[:-1]), _auth(token + "x"), {TOKEN_HEADER: token}, _auth(token, "999")):
        http.get(f"{url}/status", headers=h)
        http.post(f"{url}/call", content=b"x", headers={**h, CALL_HEADER: _call_meta()})
    with pytest.raises(ValueError):
        remote("raise")
    remote.options(stream_logs=True)("env")
    _raw(
        srv["ports"][0],
        _head("POST", "/call", {**_auth(token), CALL_HEADER: _call_meta()}, 5000) + b"k" * 10,
    )
    _assert_serving(remote, srv, http)
    time.sleep(0.2)
    files = [p for p in srv["dir"].iterdir() if p.is_file() and p.name != "state.json"]
    logs = [p for p in files if p.name.endswith(".log")]
    assert len(logs) == 2
    assert any("env:" in p.read_text(errors="replace") for p in logs), (
        "the rank output never reached the log"
    )
    for p in files:
        _no_token(token, p.read_bytes(), str(p))
