"""Issue 9, item 1: a proxied call whose stream breaks is re-attached, never lost, never run twice.

The pods are real local server processes; between them and the caller sits a transport that
cuts the response of a share of the calls, right after its headers or part-way through its
frames, as the Kubernetes API server's pod proxy does (Go's reverse-proxy race). Every call
appends its number to a ledger file per rank, so a call that ran twice shows.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.net.client import PodClient
from ktlite_wire import envelope
from ktlite_wire.errors import ErrorCode
from ktlite_wire.frames import HEARTBEAT, RESULT, read_frames
from ktlite_wire.headers import (
    CALL_HEADER,
    ERROR_CODE_HEADER,
    LENGTH_HEADER,
    RESUME_HEADER,
    TOKEN_HEADER,
    UPTIME_HEADER,
    bearer,
)
from ktlite_wire.plan import CallPlan

NAME = f"reattach-{uuid.uuid4().hex[:6]}"
CALLS = 150


def record(ledger: str, i: int, lines: int = 0, payload: bytes = b"") -> int:
    """Print ``lines`` lines, append ``i`` to this rank's ledger, return ``i``."""
    rank = os.environ["RANK"]
    for k in range(lines):
        print(f"call {i} line {k}", flush=True)
    with open(f"{ledger}-{rank}", "a") as f:
        f.write(f"{i}\n")
    return i


class _Cut(httpx.SyncByteStream):
    """A response body that ends early, as a proxy that dropped its upstream connection."""

    def __init__(self, inner: Any, keep: int) -> None:
        self.inner, self.keep = inner, keep

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        for chunk in self.inner:
            if sent + len(chunk) > self.keep:
                yield chunk[: self.keep - sent]
                break
            sent += len(chunk)
            yield chunk
        self.inner.close()  # the pod sees its caller go
        raise httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body (incomplete chunked read)"
        )

    def close(self) -> None:
        self.inner.close()


class CuttingProxy(httpx.BaseTransport):
    """Forwards to the pods; cuts ``rate`` of the POST /call responses after ``keep`` bytes
    (0: right after the headers; some: mid-frame)."""

    def __init__(self, rate: float, seed: int = 7) -> None:
        self.inner = httpx.HTTPTransport()
        self.rate = rate
        self.random = random.Random(seed)
        self.cuts = 0
        self.resumes = 0
        self.sent: list[int] = []  # body sizes of the requests, in order

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if RESUME_HEADER in request.headers:
            self.resumes += 1
        self.sent.append(
            int(request.headers.get("content-length") or request.headers.get(LENGTH_HEADER) or 0)
        )
        resp = self.inner.handle_request(request)
        if (
            request.method == "POST"
            and request.url.path.endswith("/call")
            and resp.status_code == 200
            and self.random.random() < self.rate
        ):
            self.cuts += 1
            keep = self.random.choice([0, 0, 5, 40, 200])
            return httpx.Response(
                resp.status_code, headers=resp.headers, stream=_Cut(resp.stream, keep)
            )
        return resp

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(record, name=NAME).to(
        kt.Compute(cpus=1, stream_logs=False).distribute("spmd", workers=2)
    )
    yield r
    LocalBackend.shared().teardown(NAME, timeout=5)


def _through(remote: Any, proxy: CuttingProxy) -> PodClient:
    """Make ``remote`` call its pods through ``proxy`` (the path calls through the Kubernetes
    API server take); returns the client it replaced."""
    dep = remote.deployment
    old = dep.client
    dep.client = PodClient(dep.applied.token, transport=proxy)
    return old


def _ledger(path: Path, rank: int) -> list[int]:
    text = Path(f"{path}-{rank}").read_text() if Path(f"{path}-{rank}").exists() else ""
    return [int(x) for x in text.split()]


@pytest.mark.timeout(240)
def test_cut_streams_are_reattached_and_no_call_runs_twice(remote, tmp_path) -> None:
    proxy = CuttingProxy(rate=0.3)
    old = _through(remote, proxy)
    ledger = tmp_path / "ledger"
    try:
        for i in range(CALLS):
            assert remote(str(ledger), i, i % 3) == [i, i], i
    finally:
        remote.deployment.client.close()
        remote.deployment.client = old
    assert proxy.cuts > 20 and proxy.resumes >= proxy.cuts, (proxy.cuts, proxy.resumes)
    for rank in (0, 1):
        assert _ledger(ledger, rank) == list(range(CALLS)), (
            f"rank {rank} ran a call twice or missed one"
        )


@pytest.mark.timeout(120)
def test_log_lines_survive_a_cut_once_each(remote, tmp_path, capfd) -> None:
    """Every line printed during a call whose stream was cut arrives once: the re-attached
    stream goes on from the first frame the caller lacks."""
    proxy = CuttingProxy(rate=1.0, seed=3)  # every first attempt is cut; re-attaches are too
    proxy.random = _FirstOnly()
    old = _through(remote, proxy)
    try:
        capfd.readouterr()
        assert remote.options(stream_logs=True)(str(tmp_path / "l"), 7, 20) == [7, 7]
        out = capfd.readouterr().out
    finally:
        remote.deployment.client.close()
        remote.deployment.client = old
    for rank in (0, 1):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[rank {rank} @")]
        assert [ln.split("] ", 1)[1] for ln in lines] == [f"call 7 line {k}" for k in range(20)], (
            out
        )


@pytest.mark.timeout(120)
def test_a_large_call_cut_after_its_answer_is_not_uploaded_again(
    remote, tmp_path, monkeypatch
) -> None:
    """Bodies over 8 MiB keep their Content-Length (Go's race can hit them); a cut after the
    pod answered costs a re-attach without a body, never a second upload or a second run."""
    monkeypatch.setenv("KTLITE_SHM", "0")  # the bytes go over HTTP, as to a cluster
    proxy = CuttingProxy(rate=1.0)
    proxy.random = _FirstOnly()
    old = _through(remote, proxy)
    try:
        assert remote(str(tmp_path / "big"), 1, 0, os.urandom(9 << 20)) == [1, 1]
    finally:
        remote.deployment.client.close()
        remote.deployment.client = old
    assert proxy.cuts == 1 and proxy.resumes == 1, (proxy.cuts, proxy.resumes)
    assert [size > 9 << 20 for size in proxy.sent] == [True, False], proxy.sent
    for rank in (0, 1):
        assert _ledger(tmp_path / "big", rank) == [1]


class _FirstOnly(random.Random):
    """Cuts the first call response only (after 40 bytes: mid-stream), never a re-attach."""

    def __init__(self) -> None:
        super().__init__(0)
        self.n = 0

    def random(self) -> float:
        self.n += 1
        return 0.0 if self.n == 1 else 1.0

    def choice(self, seq: Any) -> Any:
        return 40


def _raw_call(
    client: httpx.Client,
    url: str,
    token: str,
    call_id: str,
    parts: list[Any],
    resume: int | None = None,
    reattach: float = 10.0,
) -> httpx.Response:
    meta = {"id": call_id, "pods": [url], "names": ["p0"], "fanout": True, "reattach": reattach}
    headers = {
        TOKEN_HEADER: bearer(token),
        CALL_HEADER: json.dumps(meta),
        LENGTH_HEADER: str(envelope.parts_size(parts)),
    }
    if resume is not None:
        headers[RESUME_HEADER] = str(resume)
    return client.post(
        f"{url}/call",
        content=b"".join(bytes(memoryview(p)) for p in parts),
        headers=headers,
        timeout=30,
    )


def test_the_pod_answers_resumes_by_what_it_knows(remote, tmp_path) -> None:
    """A second request with a known call id attaches (the call ran once); a re-attach to a
    call the pod never had is refused with 404, so the caller never re-runs a lost call."""
    dep = remote.deployment
    url, token = dep.endpoints[0].url, dep.applied.token
    from ktlite.net import packaging

    parts = packaging.encode_call(None, (str(tmp_path / "raw"), 1), {})
    with httpx.Client() as client:
        call_id = uuid.uuid4().hex
        first = _raw_call(client, url, token, call_id, parts)
        again = _raw_call(client, url, token, call_id, parts, resume=0)
        assert first.status_code == again.status_code == 200
        frames = [k for k, _ in read_frames([again.content]) if k != HEARTBEAT]
        assert frames and frames[-1] == RESULT
        unknown = _raw_call(client, url, token, uuid.uuid4().hex, [], resume=3)
        assert unknown.status_code == 404 and "does not know call" in unknown.text
    # ran on pod 0's rank only once (the fan-out went to pod 0 alone: its plan names one pod)
    assert _ledger(tmp_path / "raw", 0) == [1]


# ---- item 8: a proxy that cannot reach the pod -----------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "delivered"),
    [
        (
            503,
            {
                "kind": "Status",
                "code": 503,
                "message": "error trying to reach service: dial tcp "
                "10.244.0.9:32300: connect: connection refused",
            },
            False,
        ),
        (400, {"kind": "Status", "code": 400, "message": "address not allowed"}, False),
        (404, {"kind": "Status", "code": 404, "message": 'pods "job-0" not found'}, False),
        (502, "Bad Gateway", True),
        (504, "Gateway Timeout", True),
    ],
)
def test_a_proxy_that_cannot_reach_the_pod_gives_pod_unreachable_naming_it(
    monkeypatch, status, body, delivered
) -> None:
    import ktlite.net.proxycall as proxycall

    monkeypatch.setattr(proxycall, "RESUME_WINDOW_S", 0.3)
    asked = []

    def proxy(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        if isinstance(body, dict):
            return httpx.Response(status, json=body)
        return httpx.Response(status, text=body)

    client = PodClient("t0k3n", transport=httpx.MockTransport(proxy))
    with pytest.raises(kt.PodUnreachable) as info:
        client.call(
            "https://api/pods/job-0:32300/proxy", CallPlan(id="c1"), [b"x"], None, pod="job-0"
        )
    text = str(info.value)
    assert "job-0" in text and f"HTTP {status}" in text, text
    assert info.value.delivered is delivered
    assert len(asked) > 1, "a proxy error is retried within the re-attach window"
    assert "t0k3n" not in text


@pytest.mark.parametrize("uptime, lost", [("600.000", False), ("0.010", True), (None, True)])
def test_a_cut_attempt_then_no_code_is_lost_only_if_the_server_is_newer(uptime, lost) -> None:
    """The first attempt reaches a pod and its answer is cut; the next finds a server without
    our code. Up since before the first attempt, that server got both attempts and refused
    both: the call never ran anywhere (NotDeployedError: heal and run it). Newer (or silent
    about it), an older server may have run the call before it went (PodUnreachable)."""
    asked = []

    def proxy(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        if len(asked) == 1:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            )
        headers = {ERROR_CODE_HEADER: ErrorCode.NOT_DEPLOYED.value}
        if uptime is not None:
            headers[UPTIME_HEADER] = uptime
        return httpx.Response(
            409, json={"detail": "pod job-0 has no code deployed"}, headers=headers
        )

    client = PodClient("t0k3n", transport=httpx.MockTransport(proxy))
    expected = kt.PodUnreachable if lost else kt.NotDeployedError
    with pytest.raises(expected) as info:
        client.call(
            "https://api/pods/job-0:32300/proxy", CallPlan(id="c1"), [b"x"], None, pod="job-0"
        )
    assert len(asked) == 2
    assert ("was restarted or replaced while the call ran" in str(info.value)) is lost
