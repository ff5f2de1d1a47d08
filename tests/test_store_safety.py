"""A data store that tenants can share (issue 25, item 6): keys a filesystem can hold, the
root deleted only by an explicit wipe, a cap on the bytes the store holds, tokens scoped to a
deployment's key prefix, and objects signed by their writer. Against the local store (real
files) and the store server (``python -m ktlite_server`` in store mode, a real process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import ktlite as kt
from ktlite.datastore.store import wipe
from ktlite.errors import ConfigError
from ktlite_wire.headers import ERROR_CODE_HEADER, TOKEN_HEADER, bearer
from tests.test_store_limits import Store, store_server


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "home"))
    for env in (
        "KTLITE_NAMESPACE",
        "KTLITE_STORE_HOME",
        "KTLITE_STORE_NAMESPACE",
        "KTLITE_BACKEND",
    ):
        monkeypatch.delenv(env, raising=False)
    return tmp_path / "home"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Store]:
    with store_server(tmp_path) as s:
        yield s


def _auth(token: str) -> dict[str, str]:
    return {TOKEN_HEADER: bearer(token)}


# ---- keys a filesystem can hold -------------------------------------------------------------------

LONG = "s" * 300  # one segment: a file name over every common filesystem's 255 bytes


def test_an_over_long_segment_is_a_400_from_the_server(server: Store) -> None:
    for method in ("PUT", "GET", "DELETE"):
        resp = httpx.request(
            method,
            f"{server.url}/store/v1/key",
            params={"key": f"a/{LONG}"},
            content=b"x" if method == "PUT" else None,
            headers=_auth(server.token),
        )
        assert resp.status_code == 400, (method, resp.status_code, resp.text)
        assert resp.headers[ERROR_CODE_HEADER] == "bad_request"
        assert "300 bytes long, over the 255 bytes a segment may have" in resp.json()["detail"]
    ok = httpx.put(
        f"{server.url}/store/v1/key",
        params={"key": "a/" + "s" * 255},
        content=b"x",
        headers=_auth(server.token),
    )
    assert ok.status_code == 200, ok.text


def test_an_over_long_segment_is_refused_by_the_client_before_it_sends(home: Path) -> None:
    with pytest.raises(ConfigError, match="300 bytes long, over the 255 bytes"):
        kt.put(f"a/{LONG}", 1)
    with pytest.raises(ConfigError, match="over the 255 bytes"):
        kt.put("a/" + "é" * 128, 1)  # 256 bytes in UTF-8
    kt.put("a/" + "é" * 127, 1)
    assert [e["name"] for e in kt.ls("a")] == ["é" * 127]


# ---- the root: only an explicit wipe ---------------------------------------------------------------


@pytest.mark.parametrize("root", ["", "/"])
def test_rm_never_deletes_the_root_of_the_local_store(home: Path, root: str) -> None:
    kt.put("a/b", 1)
    kt.put("c", 2)
    for recursive in (True, False):
        with pytest.raises(ConfigError, match="root is not removed by rm.*`ktlite store wipe`"):
            kt.rm(root, recursive=recursive)
    assert [e["key"] for e in kt.ls()] == ["a", "c"]
    assert wipe() == 2
    assert kt.ls() == []


def test_the_store_server_refuses_to_delete_its_root_and_wipes_on_the_explicit_call(
    server: Store,
) -> None:
    auth = _auth(server.token)
    assert httpx.put(f"{server.url}/store/v1/key?key=a/b", content=b"x", headers=auth).is_success
    resp = httpx.delete(
        f"{server.url}/store/v1/key", params={"key": "", "recursive": "1"}, headers=auth
    )
    assert resp.status_code == 400 and "`ktlite store wipe`" in resp.json()["detail"], resp.text
    assert [e["key"] for e in httpx.get(f"{server.url}/store/v1/ls", headers=auth).json()] == ["a"]
    resp = httpx.post(f"{server.url}/store/v1/wipe", headers=auth)
    assert resp.json() == {"removed": 1}, resp.text
    assert httpx.get(f"{server.url}/store/v1/ls", headers=auth).json() == []


def test_store_wipe_asks_as_teardown_all_does(home: Path) -> None:
    from test_store_cli import run

    run(home, "put", "k", "--value", "A")
    refused = run(home, "store", "wipe", ok=False)
    assert refused.returncode == 2, refused
    assert refused.stderr.startswith("ktlite: error: store wipe asks before it deletes every key")
    assert "no terminal to ask on: pass --yes (-y)" in refused.stderr
    assert run(home, "rm", "", "-r", ok=False).returncode == 1
    assert json.loads(run(home, "get", "k").stdout) == "A"
    assert "wiped (1 top-level key(s) removed)" in run(home, "store", "wipe", "-y").stdout
    assert run(home, "ls").stdout == ""
