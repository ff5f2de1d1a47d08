"""Issue 4, point 6: no silent re-execution.

- The same call id delivered twice (``POST /call`` with the same ``id`` in the
  ``x-ktlite-call`` header, one after the other or at once, to the coordinator or to a
  member pod) runs once, and the duplicate gets the first run's result.
- A call is never retried once it may have started: when the connection between the
  coordinator and a worker pod breaks mid-call (both pods stay alive; a TCP proxy in this
  process resets the connection), the call fails naming the pod and no rank runs it again.
  (The pod-death tests in ``test_pod_death.py`` check the same after a pod dies.)

Requests are built as ``tests/test_server_auth.py`` builds them, from the local backend's
``state.json`` (token, ports). Every rank appends one line per attempt to its own file
(``faults_mod.beat``); "ran once" means one line.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import faults_mod as fm
import httpx
import pytest

import ktlite as kt
from ktlite.api.remote import RemoteFunction
from ktlite.backends.local import LocalBackend
from ktlite.modes.deploy import attach
from ktlite.net import packaging
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import codec, shm
from ktlite_wire.frames import ERROR, RESULT, read_frames
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.outcome import CallResult, ShmRef
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

NAME = "fx-dup"
COMPUTE = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=2, num_proc=1)


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(fm.beat, name=NAME).to(COMPUTE)
    yield r
    LocalBackend.shared().teardown(NAME, timeout=5.0)


@pytest.fixture
def state(remote) -> dict[str, Any]:
    state = fm.local_state(NAME)
    with httpx.Client(timeout=5.0) as client:
        state["launch_id"] = client.get(
            f"{state['urls'][0]}/health", headers={"x-ktlite-token": f"Bearer {state['token']}"}
        ).json()["launch_id"]
    return state


def _post(
    state: dict[str, Any],
    call_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    pod: int = 0,
) -> list[tuple[int, bytearray]]:
    """One raw delivery of a call (fan-out from pod 0, or to ``pod`` alone); its frames."""
    meta = {"id": call_id, "launch_id": state["launch_id"], "stream_logs": False}
    if pod == 0:
        meta.update(
            {
                "fanout": True,
                "pods": state["urls"],
                "names": [p["name"] for p in state["pods"]],
                "num_proc": 1,
                "quorum_timeout": 10,
            }
        )
    else:
        meta["fanout"] = False
    body = b"".join(bytes(memoryview(p)) for p in packaging.encode_call(None, args, kwargs or {}))
    headers = {
        TOKEN_HEADER: bearer(state["token"]),
        VERSION_HEADER: str(PROTOCOL_VERSION),
        CALL_HEADER: json.dumps(meta),
        "content-type": "application/octet-stream",
    }
    with httpx.Client(timeout=60.0) as client:
        resp = client.post(f"{state['urls'][pod]}/call", headers=headers, content=body)
    assert resp.status_code == 200, resp.text
    return list(read_frames([resp.content]))


def _outcomes(frames: list[tuple[int, bytearray]]) -> dict[int, tuple[str, Any]]:
    """rank -> ("ok", value) or (status, message), from a delivery's RESULT frame."""
    errors = [json.loads(p) for k, p in frames if k == ERROR]
    assert not errors, f"the delivery failed: {errors}"
    results = [p for k, p in frames if k == RESULT]
    assert len(results) == 1, frames
    out = {}
    for outcome in CallResult.decode(results[0]).outcomes:
        rank, _pod, status, data, message = outcome[:5]
        if isinstance(data, ShmRef):  # a shared-memory hand-off (not asked for here)
            data = shm.take(data.path, data.size)
        out[rank] = (status, codec.loads(data)) if status is Status.OK else (status, message)
    return out


def _attempts(d: Path, tag: str) -> list[int]:
    return [len(fm.starts(d, tag, r)) for r in range(2)]


@pytest.mark.timeout(60)
def test_same_call_id_twice_runs_once(state, tmp_path) -> None:
    call_id = uuid.uuid4().hex
    first = _outcomes(_post(state, call_id, (str(tmp_path), "a", 0)))
    assert first == {0: ("ok", 0), 1: ("ok", 1)}
    again = _outcomes(_post(state, call_id, (str(tmp_path), "a", 0)))
    assert again == first
    # delivered once more, straight to the member pod: it answers from its own record
    assert _outcomes(_post(state, call_id, (str(tmp_path), "a", 0), pod=1)) == {1: ("ok", 1)}
    assert _attempts(tmp_path, "a") == [1, 1]


@pytest.mark.timeout(60)
def test_same_call_id_at_once_runs_once(state, tmp_path) -> None:
    call_id = uuid.uuid4().hex
    got: dict[int, Any] = {}

    def deliver(i: int) -> None:
        got[i] = _outcomes(_post(state, call_id, (str(tmp_path), "b", 1.0)))

    threads = [threading.Thread(target=deliver, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {i: {0: ("ok", 0), 1: ("ok", 1)} for i in range(3)}
    assert _attempts(tmp_path, "b") == [1, 1]


@pytest.mark.timeout(60)
def test_cancelled_call_id_never_runs_even_delivered_twice(state, tmp_path) -> None:
    """The stop overtakes the call (it arrives first): neither delivery starts a rank."""
    call_id = uuid.uuid4().hex
    headers = {TOKEN_HEADER: bearer(state["token"]), VERSION_HEADER: str(PROTOCOL_VERSION)}
    with httpx.Client(timeout=10.0) as client:
        for url in state["urls"]:
            resp = client.post(f"{url}/cancel/{call_id}", headers=headers)
            assert resp.status_code == 200 and resp.json() == {"cancelled": False}
    for _ in range(2):
        out = _outcomes(_post(state, call_id, (str(tmp_path), "c", 0)))
        assert {r: s for r, (s, _) in out.items()} == {0: "cancelled", 1: "cancelled"}, out
    assert _attempts(tmp_path, "c") == [0, 0]


@pytest.mark.timeout(60)
def test_duplicate_delivery_of_a_large_result_runs_once_and_says_so(state, tmp_path) -> None:
    """Results over 1 MiB are not kept after delivery (they would pile up in memory): a
    duplicate request still runs nothing and gets an outcome saying the result went out."""
    call_id = uuid.uuid4().hex
    nbytes = 2 * shm.INLINE_MAX
    args = (str(tmp_path), "big", 0)
    first = _outcomes(_post(state, call_id, args, {"nbytes": nbytes}))
    assert first == {0: ("ok", b"A" * nbytes), 1: ("ok", b"B" * nbytes)}
    assert _attempts(tmp_path, "big") == [1, 1]
    again = _outcomes(_post(state, call_id, args, {"nbytes": nbytes}))
    assert _attempts(tmp_path, "big") == [1, 1]
    assert {r: s for r, (s, _) in again.items()} == {0: "cancelled", 1: "cancelled"}
    assert all("already delivered" in m for _, m in again.values()), again


@pytest.mark.timeout(60)
def test_broken_connection_to_a_worker_pod_is_never_retried(remote, tmp_path) -> None:
    """Both pods stay up; only the coordinator's connection to pod 1 breaks mid-call."""
    backend = LocalBackend.shared()
    original = backend._read(NAME)
    proxy = fm.Proxy(original["pods"][1]["port"])
    routed = json.loads(json.dumps(original))
    routed["pods"][1]["port"] = proxy.port  # the caller tells the coordinator where pod 1 is
    backend._write(NAME, routed)
    try:
        via = RemoteFunction(
            kt.fn(fm.beat, name=NAME),
            attach(DeploymentSpec(name=NAME, pod=COMPUTE.pod_spec(), kind="fn")),
            compute=COMPUTE,
        )
        assert via(str(tmp_path), "warm", 0) == [0, 1]
        call = fm.Call(via, str(tmp_path), "x", 30)
        assert fm.wait_for(lambda: fm.all_beating(tmp_path, "x", range(2)), 30)
        t0 = time.monotonic()
        proxy.break_all()
        # a guard against a hang, past the call's own 30 s (had nothing failed it, it would
        # have returned by then, and the checks of its error below fail)
        assert call.join(60), "the call hangs after its connection to pod 1 broke"
        took = call.ended - t0
        fm.report("connection to worker pod reset -> call fails", took, 10.0)
        # no wall-clock bound: left alone the call would return after its 30 s; its error
        # naming pod 1 (below) shows the reset ended it
        err = call.error
        assert isinstance(err, kt.RemoteError), repr(err)
        assert f"pod {NAME}-1" in str(err), str(err)
        # both ranks stop (pod 1 sees its caller's stream close), and neither runs it again
        for r in range(2):
            last = fm.last_beat_after_quiet(tmp_path, "x", r, quiet=1.0, timeout=10)
            assert last is not None and last - t0 <= 10.0, f"rank {r} still runs the call"
            fm.report(f"connection to worker pod reset: rank {r} stops", max(0.0, last - t0), 10.0)
        time.sleep(1.0)  # a retry would have started by now
        assert _attempts(tmp_path, "x") == [1, 1]
        assert via(str(tmp_path), "next", 0) == [0, 1]  # the route works again: new connections
    finally:
        backend._write(NAME, original)
        proxy.close()
    assert kt.fn(fm.beat, name=NAME).to(COMPUTE)(str(tmp_path), "direct", 0) == [0, 1]
    assert _attempts(tmp_path, "x") == [1, 1]
