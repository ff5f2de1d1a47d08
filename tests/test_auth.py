"""Point 7: every endpoint but /health needs the deployment token; nothing runs without it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

import ktlite as kt

NAME = "auth-check"


def touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(touch, name=NAME).to(kt.Compute(cpus=1, stream_logs=False))
    yield r
    r.teardown()


def _state() -> dict:
    with open(Path(os.environ["KTLITE_HOME"]) / "local" / NAME / "state.json") as f:
        return json.load(f)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "wrong"])
def test_endpoints_refuse_missing_or_wrong_token(remote, tmp_path, auth) -> None:
    url = f"http://127.0.0.1:{_state()['pods'][0]['port']}"
    headers = {} if auth is None else {"authorization": auth}
    marker = tmp_path / "marker"
    assert httpx.get(f"{url}/health").status_code == 200
    for method, path in (("GET", "/status"), ("POST", "/call"), ("POST", "/deploy"), ("POST", "/cancel/x")):
        resp = httpx.request(method, f"{url}{path}", headers={**headers, "x-ktlite-call": json.dumps({"id": "x"})},
                             content=b"garbage")
        assert resp.status_code == 401, (path, resp.status_code)
    assert not marker.exists()
    assert remote(str(marker)) == str(marker)  # the server still serves with the right token
    assert marker.exists()


def test_token_never_in_repr_or_logs(remote) -> None:
    token = _state()["token"]
    assert token not in repr(remote) and token not in repr(remote.deployment)
    assert token not in repr(remote.deployment.client) and token not in repr(remote.deployment.applied)
    plan = kt.fn(touch, name=NAME).to(kt.Compute(cpus=1), dryrun=True)
    assert token not in str(plan)
    logs = (Path(os.environ["KTLITE_HOME"]) / "local" / NAME).glob("pod-*.log")
    for log in logs:
        assert token not in log.read_text(errors="replace")


def test_malformed_deploy_body_is_4xx_and_server_keeps_serving(remote, tmp_path) -> None:
    state = _state()
    url = f"http://127.0.0.1:{state['pods'][0]['port']}"
    resp = httpx.post(f"{url}/deploy", headers={"authorization": f"Bearer {state['token']}"}, content=b"\x00" * 64)
    assert 400 <= resp.status_code < 500
    assert "malformed" in resp.text
    assert remote(str(tmp_path / "m")) == str(tmp_path / "m")
