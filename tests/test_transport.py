"""Large payloads take two roads: shared-memory files when the caller shares the pods' host
(the local backend), HTTP bodies otherwise (clusters; forced here with KTLITE_SHM=0). Both
must deliver the same bytes, writable, across pods, and leave no file behind."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import ktlite as kt
from ktlite_wire import shm
from ktlite_wire.headers import TOKEN_HEADER


def scale(x, factor):
    import os

    return x * (factor + int(os.environ["RANK"]))


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(scale, name="transport").to(
        kt.Compute(cpus=1, stream_logs=False).distribute(workers=2, num_proc=1)
    )
    yield r
    r.teardown()


def _leftovers() -> list[str]:
    return [n for n in os.listdir(shm.shm_dir()) if n.startswith(("ktlite-arg-", "ktlite-res-"))]


@pytest.mark.parametrize("road", ["shm", "http"])
def test_large_numpy_both_roads(remote, monkeypatch, road) -> None:
    monkeypatch.setenv("KTLITE_SHM", "1" if road == "shm" else "0")
    before = set(_leftovers())
    x = np.arange(3 << 20, dtype=np.float64)  # 24 MB, past the inline limit
    out = remote(x, 2)
    assert len(out) == 2
    for rank, y in enumerate(out):
        assert np.array_equal(y, x * (2 + rank))
        assert y.flags.writeable
    _assert_no_new_files(before)


def _assert_no_new_files(before: set[str]) -> None:
    # other xdist workers move large payloads too: only a file that stays is a leak
    deadline = time.monotonic() + 10
    while set(_leftovers()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_leftovers()) - before


@pytest.mark.parametrize("road", ["shm", "http"])
def test_large_torch_both_roads(remote, monkeypatch, road) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KTLITE_SHM", "1" if road == "shm" else "0")
    x = torch.arange(4 << 20, dtype=torch.float32)
    out = remote(x, 1)
    assert [torch.equal(y, x * (1 + r)) for r, y in enumerate(out)] == [True, True]
    out[0] += 1  # writable, no warning


def test_foreign_shm_path_is_refused(remote, tmp_path) -> None:
    import json

    import httpx

    state = json.loads((remote.deployment.backend._dir("transport") / "state.json").read_text())
    url = f"http://127.0.0.1:{state['pods'][0]['port']}"
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 10)
    meta = {"id": "foreign", "pods": [url], "fanout": True, "shm": [str(secret), 10]}
    resp = httpx.post(
        f"{url}/call",
        headers={TOKEN_HEADER: f"Bearer {state['token']}", "x-ktlite-call": json.dumps(meta)},
        content=b"",
    )
    assert resp.status_code == 400
    assert "shared-memory" in resp.text


def test_injected_httpx_client_road(remote, monkeypatch) -> None:
    """An injected httpx client (what the Kubernetes API proxy needs) carries calls too."""
    import httpx

    from ktlite.net.client import PodClient

    monkeypatch.setenv("KTLITE_SHM", "0")
    dep = remote.deployment
    lean = dep.client
    with httpx.Client() as http:
        dep.client = PodClient(dep.applied.token, http=http)
        try:
            x = np.arange(300_000, dtype=np.float32)  # past the inline limit: a streamed body
            out = remote(x, 3)
            assert [np.array_equal(y, x * (3 + r)) for r, y in enumerate(out)] == [True, True]
            with pytest.raises(TypeError):
                remote(object(), 1)  # errors travel the same road
        finally:
            dep.client = lean


def test_heartbeats_keep_a_quiet_long_call_alive(remote, monkeypatch) -> None:
    """A call that prints nothing for longer than the caller's silence limit still succeeds:
    pods send heartbeats (every 2 s) through the coordinator to the caller."""
    import ktlite.net.client

    monkeypatch.setattr(ktlite.net.client, "SILENCE_TIMEOUT", 3.0)
    assert remote.options(stream_logs=False)(_Sleepy(4.5), 1) == [4.5, 9.0]


class _Sleepy:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __mul__(self, factor: int) -> float:
        time.sleep(self.seconds)
        return self.seconds * factor
