"""Every pod endpoint but ``/health`` needs the deployment token, and the token never leaks.

One deployment (``sa-target``, 2 pods × 1 proc) is probed with raw httpx requests built
from ``$KTLITE_HOME/local/sa-target/state.json``.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

import ktlite as kt
from ktlite.net import packaging
from ktlite.net.client import PodClient
from ktlite.specs.spec import DistributedConfig
from ktlite_wire import codec, envelope
from ktlite_wire.frames import RESULT, read_frames
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER
from ktlite_wire.launch import Launch
from ktlite_wire.outcome import CallResult
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

NAME = "sa-target"


def target(mode: str, arg: object = None) -> object:
    if mode == "rank":
        return int(os.environ["RANK"])
    if mode == "touch":
        Path(str(arg)).write_text("ran")
        return "touched"
    if mode == "env":
        return dict(os.environ)
    if mode == "fail":
        raise ValueError("sa failure on purpose")
    if mode == "exit":
        os._exit(5)
    if mode == "sleep":
        time.sleep(float(arg))  # type: ignore[arg-type]
        return None
    raise AssertionError(mode)


def make_evil(marker: Path):
    def evil(*args: object) -> str:
        marker.write_text("evil")
        return "evil"

    return evil


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(target, name=NAME).to(kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1))
    yield r
    r.teardown()


@pytest.fixture(scope="module")
def state(remote) -> dict:
    path = Path(os.environ["KTLITE_HOME"]) / "local" / NAME / "state.json"
    with open(path) as f:
        data = json.load(f)
    data["urls"] = [f"http://127.0.0.1:{p['port']}" for p in data["pods"]]
    data["path"] = str(path)
    return data


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30.0) as client:
        yield client


def _auth(token: str) -> dict[str, str]:
    return {TOKEN_HEADER: f"Bearer {token}", VERSION_HEADER: str(PROTOCOL_VERSION)}


def _launch_ids(http: httpx.Client, state: dict) -> list[str]:
    return [
        http.get(f"{u}/health", headers=_auth(state["token"])).json()["launch_id"]
        for u in state["urls"]
    ]


def _call_request(path: Path) -> tuple[dict[str, str], bytes]:
    """A complete, valid single-pod /call request that makes ``target`` write ``path``."""
    meta = {"id": uuid.uuid4().hex, "fanout": False, "stream_logs": False}
    body = b"".join(
        bytes(memoryview(p)) for p in packaging.encode_call(None, ("touch", str(path)), {})
    )
    return {CALL_HEADER: json.dumps(meta), "content-type": "application/octet-stream"}, body


def _deploy_message(
    state: dict, ordinal: int, marker: Path = Path("/nonexistent/evil"), **override: object
) -> dict:
    """A launch's JSON header (its bundle in ``_bufs``), with fields overridden."""
    launch = Launch(
        launch_id="intruder",
        bundle=packaging.bundle(make_evil(marker)),
        kind="fn",
        distributed=DistributedConfig(workers=2),
        pod_ips=["127.0.0.1", "127.0.0.1"],
        ordinal=ordinal,
        master_port=state["master_port"],
        cpus=1.0,
        load_timeout=30.0,
    )
    header, bufs = envelope.decode(launch.encode())
    return {**header, "_bufs": [bytes(b) for b in bufs], **override}


def _encode(msg: dict) -> bytes:
    """A deploy body: the header as JSON, the buffers it names."""
    bufs = msg.get("_bufs", [])
    return envelope.encode_bytes({k: v for k, v in msg.items() if k != "_bufs"}, bufs)


def _bad_headers(token: str) -> dict[str, dict[str, str]]:
    wrong = ("A" if token[0] != "A" else "B") + token[1:]
    return {
        "none": {},
        "wrong-token": {TOKEN_HEADER: f"Bearer {wrong}"},
        "prefix-of-token": {TOKEN_HEADER: f"Bearer {token[:-1]}"},
        "token-plus-extra": {TOKEN_HEADER: f"Bearer {token}x"},
        "empty-bearer": {TOKEN_HEADER: "Bearer"},
        "no-scheme": {TOKEN_HEADER: token},
        "basic-scheme": {TOKEN_HEADER: f"Basic {token}"},
        "other-header": {"x-ktlite-token": token},
    }


BAD = [
    "none",
    "wrong-token",
    "prefix-of-token",
    "token-plus-extra",
    "empty-bearer",
    "no-scheme",
    "basic-scheme",
    "other-header",
]


# ---- the token gate ----------------------------------------------------------------------------


def test_state_file_is_private(state) -> None:
    assert stat.S_IMODE(os.stat(state["path"]).st_mode) == 0o600
    assert len(state["token"]) >= 32


def test_health_needs_no_token(remote, state, http) -> None:
    """Without the token /health tells liveness and the protocol only; with it, the rest."""
    for i, url in enumerate(state["urls"]):
        resp = http.get(f"{url}/health")
        assert resp.status_code == 200
        assert resp.json() == {"status": "ok", "protocol": PROTOCOL_VERSION}
        resp = http.get(f"{url}/health", headers=_auth(state["token"]))
        body = resp.json()
        assert body["status"] == "ok" and body["ordinal"] == i
        assert body["protocol"] == PROTOCOL_VERSION
        assert state["token"] not in resp.text


@pytest.mark.parametrize("bad", BAD)
def test_status_needs_token(state, http, bad) -> None:
    for url in state["urls"]:
        resp = http.get(f"{url}/status", headers=_bad_headers(state["token"])[bad])
        assert resp.status_code == 401, resp.text
        assert "ranks" not in resp.text
    # query parameters are no substitute for the header
    resp = http.get(f"{state['urls'][0]}/status", params={"token": state["token"]})
    assert resp.status_code == 401
    assert http.get(f"{state['urls'][0]}/status", headers=_auth(state["token"])).status_code == 200


@pytest.mark.parametrize("bad", BAD)
def test_call_needs_token_and_runs_nothing(state, http, tmp_path, bad) -> None:
    for i, url in enumerate(state["urls"]):
        marker = tmp_path / f"ran-{i}"
        headers, body = _call_request(marker)
        resp = http.post(
            f"{url}/call", content=body, headers={**headers, **_bad_headers(state["token"])[bad]}
        )
        assert resp.status_code == 401, resp.text
        time.sleep(0.05)
        assert not marker.exists(), f"an unauthenticated /call ran the function on pod {i}"


def test_call_with_token_runs(state, http, tmp_path) -> None:
    # positive control: the very same request with the token does run the function
    for i, url in enumerate(state["urls"]):
        marker = tmp_path / f"ran-{i}"
        headers, body = _call_request(marker)
        resp = http.post(f"{url}/call", content=body, headers={**headers, **_auth(state["token"])})
        assert resp.status_code == 200
        frames = list(read_frames([resp.content]))
        assert frames[-1][0] == RESULT
        ((rank, _pod, status, data, _msg, _at),) = CallResult.decode(frames[-1][1]).outcomes
        assert (rank, status) == (i, Status.OK) and codec.loads(data) == "touched"
        assert marker.read_text() == "ran"


@pytest.mark.parametrize("bad", BAD)
def test_deploy_needs_token(remote, state, http, tmp_path, bad) -> None:
    marker = tmp_path / "evil"
    before = _launch_ids(http, state)
    for i, url in enumerate(state["urls"]):
        body = _encode(_deploy_message(state, i, marker))
        resp = http.post(f"{url}/deploy", content=body, headers=_bad_headers(state["token"])[bad])
        assert resp.status_code == 401, resp.text
    assert _launch_ids(http, state) == before
    assert remote("rank", stream_logs=False) == [0, 1]  # still the original code
    assert not marker.exists()


@pytest.mark.parametrize("bad", BAD)
def test_cancel_needs_token(state, http, bad) -> None:
    for url in state["urls"]:
        resp = http.post(f"{url}/cancel/x", headers=_bad_headers(state["token"])[bad])
        assert resp.status_code == 401
        resp = http.post(
            f"{url}/cancel/x", params={"reset": "true"}, headers=_bad_headers(state["token"])[bad]
        )
        assert resp.status_code == 401
    resp = http.post(f"{state['urls'][0]}/cancel/x", headers=_auth(state["token"]))
    assert resp.status_code == 200 and resp.json() == {"cancelled": False}


def test_unauthenticated_cancel_does_not_stop_a_running_call(remote, state, http) -> None:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = remote.options(stream_logs=False)("sleep", 1.5)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    call_id = None
    deadline = time.monotonic() + 5
    while call_id is None and time.monotonic() < deadline:
        active = http.get(f"{state['urls'][0]}/status", headers=_auth(state["token"])).json()[
            "active_calls"
        ]
        call_id = active[0] if active else None
        time.sleep(0.02)
    assert call_id is not None
    for url in state["urls"]:
        resp = http.post(f"{url}/cancel/{call_id}", headers={TOKEN_HEADER: "Bearer nope"})
        assert resp.status_code == 401
    t.join(10)
    assert result == {"value": [None, None]}


def test_client_with_wrong_token_gets_auth_error(state) -> None:
    client = PodClient("definitely-not-the-token")
    try:
        with pytest.raises(kt.AuthError) as info:
            client.status(state["urls"][0])
    finally:
        client.close()
    assert "401" in str(info.value)
    assert state["token"] not in str(info.value)


# ---- malformed requests with a valid token ------------------------------------------------------


def _raw_message(pickle_bytes: bytes) -> bytes:
    return envelope.HEAD.pack(codec.MAGIC, PROTOCOL_VERSION, 0, len(pickle_bytes)) + pickle_bytes


MALFORMED = {
    "garbage": lambda st: b"this is not a ktlite message",
    "empty": lambda st: b"",
    "truncated": lambda st: _encode(_deploy_message(st, 0))[:40],
    "bad-version": lambda st: b"KTJ\x63" + envelope.encode_bytes({})[4:],
    "not-a-dict": lambda st: envelope.join(envelope.pack(envelope.MAGIC, [b"[1, 2, 3]"], [])),
    "empty-dict": lambda st: envelope.encode_bytes({}),
    "missing-bundle": lambda st: _encode(
        {k: v for k, v in _deploy_message(st, 0).items() if k != "bundle"}
    ),
    "bundle-out-of-range": lambda st: _encode(_deploy_message(st, 0, bundle=5)),
    "wrong-ordinal": lambda st: _encode(_deploy_message(st, 7)),
    "zero-workers": lambda st: _encode(_deploy_message(st, 0, distributed={"workers": 0})),
    "unknown-framework": lambda st: _encode(
        _deploy_message(st, 0, distributed={"framework": "mpi"})
    ),
    "bad-int": lambda st: _encode(_deploy_message(st, 0, master_port="not-a-port")),
    "not-json": lambda st: envelope.join(envelope.pack(envelope.MAGIC, [b"{not json"], [])),
    # what protocol 3 sent: a pickle the server would have loaded (now never unpickled)
    "a-pickle": lambda st: codec.dumps(
        {k: v for k, v in _deploy_message(st, 0).items() if k != "_bufs"}
    ),
    "corrupt-pickle": lambda st: _raw_message(b"\x80\x05this is not a pickle"),
    "empty-pickle": lambda st: _raw_message(b""),
    "pod-ips-mismatch": lambda st: _encode(_deploy_message(st, 0, pod_ips=["127.0.0.1"])),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_deploy_is_4xx_and_server_keeps_serving(remote, state, http, case) -> None:
    before = _launch_ids(http, state)
    url = state["urls"][0]
    body = MALFORMED[case](state)
    resp = http.post(f"{url}/deploy", content=body, headers=_auth(state["token"]))
    # after a 5xx uvicorn drops the connection: look at the server through a new one
    http = httpx.Client(timeout=30.0)
    problems: list[str] = []
    try:
        assert state["token"] not in resp.text
        assert http.get(f"{url}/health").status_code == 200
        if not 400 <= resp.status_code < 500:
            problems.append(f"HTTP {resp.status_code}: {resp.text[:300]}")
        if _launch_ids(http, state) != before:
            problems.append("the rejected deploy replaced the pod's deployment")
        for what, opts in (
            ("a normal call", {}),
            ("a call restarting the rank processes", {"restart_procs": True}),
        ):
            try:
                got = remote.options(stream_logs=False, **opts)("rank")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{what} failed afterwards: {type(e).__name__}: {e}")
            else:
                if got != [0, 1]:
                    problems.append(f"{what} returned {got!r}")
        assert not problems, f"malformed deploy body {case!r}:\n" + "\n".join(problems)
    finally:
        if _launch_ids(http, state) != before:
            # put the real deployment back so one failure does not spill into other tests
            kt.fn(target, name=NAME).to(
                kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1)
            )
        http.close()


def test_malformed_call_requests_are_4xx(remote, state, http, tmp_path) -> None:
    url = state["urls"][0]
    headers, body = _call_request(tmp_path / "x")
    # no or broken call header
    for bad_meta in ("", "{not json", json.dumps({"no-id": 1}), json.dumps([1])):
        resp = http.post(
            f"{url}/call",
            content=body,
            headers={**headers, CALL_HEADER: bad_meta, **_auth(state["token"])},
        )
        assert 400 <= resp.status_code < 500, (bad_meta, resp.status_code, resp.text)
    # a chunked body without Content-Length
    resp = http.post(
        f"{url}/call", content=iter([body]), headers={**headers, **_auth(state["token"])}
    )
    assert 400 <= resp.status_code < 500
    # a protocol version the server does not speak
    resp = http.post(
        f"{url}/call",
        content=body,
        headers={**headers, **_auth(state["token"]), VERSION_HEADER: "999"},
    )
    assert resp.status_code == 409
    assert not (tmp_path / "x").exists()
    assert remote("rank", stream_logs=False) == [0, 1]


# ---- the token never leaks -----------------------------------------------------------------


def test_token_not_in_reprs(remote, state) -> None:
    token = state["token"]
    dep = remote.deployment
    for text in (
        repr(remote),
        str(remote),
        repr(dep),
        repr(dep.applied),
        repr(dep.client),
        repr(dep.spec),
        json.dumps(remote.status()),
    ):
        assert token not in text
    plan = kt.fn(target, name=NAME).to(
        kt.Compute(cpus=1).distribute("spmd", workers=2), dryrun=True
    )
    assert token not in str(plan) and token not in repr(plan)


def test_token_not_in_rank_env_or_argv(remote, state) -> None:
    token = state["token"]
    envs = remote("env", stream_logs=False)
    for env in envs:
        assert "KTLITE_TOKEN" not in env
        assert all(token not in v for v in env.values())
    for pod in state["pods"]:
        argv = Path(f"/proc/{pod['pid']}/cmdline").read_bytes()
        assert token.encode() not in argv


def _error_texts(err: BaseException) -> str:
    import traceback

    parts = [
        str(err),
        repr(err),
        "\n".join(getattr(err, "__notes__", []) or []),
        "".join(traceback.format_exception(err)),
    ]
    for f in getattr(err, "failures", []):
        parts += [repr(f), f.describe(), f.traceback]
    return "\n".join(parts)


def test_token_not_in_errors(remote, state) -> None:
    token = state["token"]
    with pytest.raises(ValueError) as info:
        remote("fail", stream_logs=False)
    assert token not in _error_texts(info.value)
    with pytest.raises(kt.RankDied) as died:
        remote("exit", stream_logs=False)
    assert token not in _error_texts(died.value)
    with pytest.raises(kt.CallTimeout) as timeout:
        remote.options(timeout=0.5, stream_logs=False)("sleep", 20)
    assert token not in _error_texts(timeout.value)
    with pytest.raises(kt.SerializationError) as ser:
        remote("touch", threading.Lock())
    assert token not in _error_texts(ser.value)
    assert remote("rank", stream_logs=False) == [0, 1]


def test_token_not_in_pod_files(remote, state) -> None:
    # runs last: the pods have seen 401s, 4xx, errors, a rank death and a timeout by now
    token = state["token"].encode()
    d = Path(state["path"]).parent
    files = [p for p in d.iterdir() if p.name != "state.json"]
    assert any(p.name.endswith(".log") for p in files)
    for p in files:
        assert token not in p.read_bytes(), f"the token leaked into {p}"
