"""A submitted call to one pod reached directly is a lean ``RUN`` over the caller's link
(``linkframes.caller_run``; the pod's ``ktlite_server.callerrun``), answered with one binary
``DONE``: what it is sent as, and that the pod still does for it what it does as the call's
coordinator (the process group's generation after a failure, log lines, errors, a stop, a call
id that runs once). Real pods of the local backend; the message itself is spied on the caller."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.net import packaging
from ktlite.net.call_reply import FrameReader, answered
from ktlite.net.podlinks import LinkMux
from ktlite_wire import linkframes
from ktlite_wire.headers import TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.plan import CallPlan
from ktlite_wire.version import PROTOCOL_VERSION

WAIT_S = 120.0  # a guard against a hang


def port_or_fail(fail: bool) -> str:
    if fail:
        raise ValueError("asked to fail")
    return os.environ["MASTER_PORT"]


def say(text: str) -> str:
    print(text, flush=True)
    return text


def hold(path: str, seconds: float) -> str:
    Path(path).touch()
    time.sleep(seconds)
    return "held"


def count(path: str) -> int:
    with open(Path(path, uuid.uuid4().hex), "w"):
        pass
    return len(os.listdir(path))


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kind of each call message the caller sends over a link ("RUN" or "CALL")."""
    kinds: list[str] = []
    run, call = linkframes.run_message, linkframes.call_message

    def run_message(*args: Any) -> list[Any]:
        kinds.append("RUN")
        return run(*args)

    def call_message(*args: Any) -> list[Any]:
        kinds.append("CALL")
        return call(*args)

    monkeypatch.setattr(linkframes, "run_message", run_message)
    monkeypatch.setattr(linkframes, "call_message", call_message)
    return kinds


def test_the_fields_of_a_callers_run_and_the_calls_that_need_a_plan() -> None:
    plan = CallPlan(
        id="c1", launch_id="l1", fanout=True, pods=["http://p:1"], names=["p"], stream_logs=True
    )
    fields = linkframes.caller_run(plan)
    assert fields is not None
    run = linkframes.split_run(memoryview(fields + b"body"))
    assert (run.call_id, run.launch_id, run.generation, run.group_port) == ("c1", "l1", 0, None)
    assert run.flags == linkframes.COORDINATE | linkframes.STREAM_LOGS
    assert bytes(run.body) == b"body"
    two = CallPlan(id="c2", fanout=True, pods=["http://p:1", "http://q:1"], names=["p", "q"])
    needs_plan = [
        CallPlan(id="c3", fanout=True, pods=["http://p:1"], names=["p"], timeout=5.0),
        CallPlan(id="c4", fanout=True, pods=["http://p:1"], names=["p"], reattach=10.0),
        CallPlan(id="c5", fanout=True, pods=["http://p:1"], names=["p"], shm=["/dev/shm/x", 9]),
        CallPlan(id="c6", fanout=True, pods=["http://p:1"], names=["p"], ranks=[0]),
        two,
    ]
    assert [linkframes.caller_run(p) for p in needs_plan] == [None] * len(needs_plan)


@pytest.fixture(scope="module")
def pair():
    """One pod of two ranks (a process group of two), one call at a time."""
    remote = kt.fn(port_or_fail).to(
        kt.Compute(cpus=1, stream_logs=False).distribute("spmd", num_proc=2), name="callrun"
    )
    yield remote
    remote.teardown()


def test_a_failed_submitted_call_moves_the_pods_group_to_a_new_port(pair, sent) -> None:
    before = pair.submit(False).result(timeout=WAIT_S)
    assert len(set(before)) == 1  # both ranks agree
    with pytest.raises(kt.RemoteError, match="asked to fail"):
        pair.submit(True).result(timeout=WAIT_S)
    after = pair.submit(False).result(timeout=WAIT_S)
    assert len(set(after)) == 1 and after[0] != before[0]
    assert sent == ["RUN"] * 3


@pytest.fixture(scope="module")
def pod():
    remote = kt.fn(count).to(kt.Compute(cpus=1, concurrency=4, stream_logs=False), name="callrun1")
    yield remote
    remote.teardown()


def test_submitted_calls_to_one_pod_are_runs_and_each_runs_once(pod, sent, tmp_path) -> None:
    futures = [pod.submit(str(tmp_path)) for _ in range(12)]
    assert all(f.result(timeout=WAIT_S) >= 1 for f in futures)
    assert sent == ["RUN"] * 12 and len(os.listdir(tmp_path)) == 12
    pod.options(timeout=60).submit(str(tmp_path)).result(timeout=WAIT_S)  # needs its plan
    assert sent[-1] == "CALL" and len(os.listdir(tmp_path)) == 13


def test_a_run_sent_twice_with_one_call_id_runs_once(pod, tmp_path) -> None:
    dep = pod.deployment
    ep = dep.endpoints[0]
    plan = CallPlan(
        id=uuid.uuid4().hex,
        launch_id=dep.launch_id,
        fanout=True,
        pods=[ep.url],
        names=[ep.name],
        stream_logs=False,
    )
    fields = linkframes.caller_run(plan)
    assert fields is not None
    headers = {TOKEN_HEADER: bearer(dep.applied.token), VERSION_HEADER: str(PROTOCOL_VERSION)}
    parts = packaging.encode_call(None, (str(tmp_path),), {})
    replies = [  # the same id on two links, one after the other
        _run(mux, ep.url, headers, fields, parts) for mux in (LinkMux(), LinkMux())
    ]
    assert all(error is None for _, error in replies), replies
    assert len(os.listdir(tmp_path)) == 1


def _run(mux: LinkMux, url: str, headers: dict, fields: bytes, parts: list) -> tuple:
    """A RUN over ``mux``, waited for: (reply, error)."""
    ended = threading.Event()
    got: list[Any] = []
    frames = FrameReader(None, None, url)

    def done(reply: Any, error: BaseException | None) -> None:
        got.append((reply, error))
        ended.set()

    finish = answered(frames, url, 30.0, done)
    mux.start(url, headers, fields, parts, None, 30.0, frames.frame, finish, 10.0, frames.done)
    assert ended.wait(WAIT_S)
    return got[0]


def test_a_submitted_runs_log_lines_reach_the_caller(capfd) -> None:
    remote = kt.fn(say).to(kt.Compute(cpus=1, stream_logs=True), name="callrunlog")
    try:
        assert remote.submit("hello over a run").result(timeout=WAIT_S) == "hello over a run"
        assert "hello over a run" in capfd.readouterr().out
    finally:
        remote.teardown()


def test_cancelling_one_submitted_run_stops_that_call_only(tmp_path) -> None:
    remote = kt.fn(hold).to(
        kt.Compute(cpus=1, concurrency=2, stream_logs=False), name="callrunstop"
    )
    try:
        long = remote.submit(str(tmp_path / "long"), 300.0)
        short = remote.submit(str(tmp_path / "short"), 0.5)
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "long").exists():  # the long call runs on its rank
            assert time.monotonic() < deadline, "the long call never started"
            time.sleep(0.05)
        assert long.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            long.result(timeout=WAIT_S)
        assert short.result(timeout=WAIT_S) == "held"
        assert remote.submit(str(tmp_path / "again"), 0.0).result(timeout=WAIT_S) == "held"
    finally:
        remote.teardown()
