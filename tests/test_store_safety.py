"""A data store that tenants can share (issue 25, item 6): keys a filesystem can hold, the
root deleted only by an explicit wipe, a cap on the bytes the store holds, tokens scoped to a
deployment's key prefix, and objects signed by their writer. Against the local store (real
files) and the store server (``python -m ktlite_server`` in store mode, a real process)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import ktlite as kt
from ktlite.datastore import location
from ktlite.datastore.signing import Signer
from ktlite.datastore.store import wipe
from ktlite.errors import ConfigError, DataStoreError
from ktlite_wire import codec
from ktlite_wire.headers import ERROR_CODE_HEADER, TOKEN_HEADER, bearer
from ktlite_wire.storedir import OBJECT_MAGIC, tar_stream
from ktlite_wire.storescope import Grant, mint
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


# ---- tokens scoped to a deployment's prefix --------------------------------------------------------


class _StoreBackend:
    """What the Kubernetes backend reports of the namespace's store: its address and its master
    key (the Secret's token), which :func:`handoff` turns into what a deployment's pods get."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def store_handoff(self) -> dict[str, str]:
        return {"url": self.url, "token": self.token, "pod": "ktlite-store-0", "namespace": "ns"}


def _status(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.headers.get(ERROR_CODE_HEADER, "")


def test_a_scoped_token_reaches_its_grants_only(server: Store) -> None:
    url, full = f"{server.url}/store/v1", _auth(server.token)
    for key in ("dep-a/own", "dep-b/secret", "datasets/d", "shared/s", "top"):
        assert httpx.put(f"{url}/key", params={"key": key}, content=b"v", headers=full).is_success
    token = mint(
        server.token, "dep-a", (Grant("dep-a", True), Grant("datasets"), Grant("shared", True))
    )
    assert server.token not in token
    mine = _auth(token)

    def get(key: str) -> tuple[int, str]:
        return _status(httpx.get(f"{url}/key", params={"key": key}, headers=mine))

    def put(key: str) -> tuple[int, str]:
        return _status(httpx.put(f"{url}/key", params={"key": key}, content=b"w", headers=mine))

    assert get("dep-a/own") == (200, "") and put("dep-a/new") == (200, "")
    assert get("datasets/d") == (200, "") and put("shared/t") == (200, "")
    forbidden = (403, "forbidden")
    assert get("dep-b/secret") == forbidden and get("top") == forbidden
    assert put("datasets/x") == forbidden and put("dep-b/x") == forbidden
    assert put("dep-a2/x") == forbidden  # a prefix is a whole segment, not a string prefix
    resp = httpx.get(f"{url}/key", params={"key": "dep-b/secret"}, headers=mine)
    detail = resp.json()["detail"]
    assert "the token of dep-a (read/write 'dep-a', read 'datasets', read/write 'shared')" in detail
    assert "may not read key 'dep-b/secret'" in detail and "store_access" in detail
    assert server.token not in detail and token not in detail
    deleted = httpx.delete(f"{url}/key", params={"key": "dep-b", "recursive": "1"}, headers=mine)
    assert _status(deleted) == forbidden
    assert _status(httpx.get(f"{url}/ls", headers=mine)) == forbidden  # the root: full only
    assert _status(httpx.post(f"{url}/wipe", headers=mine)) == forbidden
    assert [
        e["key"] for e in httpx.get(f"{url}/ls", params={"prefix": "dep-a"}, headers=mine).json()
    ]
    # a token minted with another key, or whose grants were edited, is no token at all
    other = mint("another-master", "dep-a", (Grant("dep-b", True),))
    payload, mac = token[len("kts1.") :].rsplit(".", 1)
    widened = "kts1." + other[len("kts1.") :].rsplit(".", 1)[0] + "." + mac
    for bad in (other, widened):
        assert _status(
            httpx.get(f"{url}/key", params={"key": "dep-b/secret"}, headers=_auth(bad))
        ) == (
            401,
            "unauthorized",
        )
    assert httpx.get(f"{url}/key", params={"key": "dep-b/secret"}, headers=full).content == b"v"


def _as_pod(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, info: dict[str, object]) -> None:
    """This process as a rank of a Kubernetes pod that was handed ``info`` at deploy time."""
    from ktlite_server.store import remember

    ips = tmp_path / "ktlite-pod-ips-7.json"
    monkeypatch.setenv("KTLITE_POD_IPS_FILE", str(ips))
    monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
    monkeypatch.setenv("KTLITE_NAMESPACE", "ns")
    remember(info, str(ips))


def test_a_deployments_pods_get_a_scoped_token_and_never_the_master_key(
    server: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ktlite.datastore.store_client import StoreClient

    user = StoreClient(server.url, server.token)
    signer = Signer.full(server.token)
    for key, value in (("datasets/mnist", [1, 2]), ("dep-b/weights", {"b": 1})):
        signed = signer.sign(key, codec.dumps(value))
        user.upload(key, "object", len(signed), lambda s=signed: iter([s]))
    info = location.handoff(
        _StoreBackend(server.url, server.token), "dep-a", (("datasets", "read"),)
    )
    assert info is not None and server.token not in json.dumps(info)
    assert info["writes"] == ["dep-a"] and set(info["keys"]) == {"dep-a", "datasets"}
    _as_pod(monkeypatch, tmp_path, info)
    kt.put("dep-a/ckpt", {"step": 3})
    assert kt.get("dep-a/ckpt") == {"step": 3}
    stored = (server.root / "data" / "dep-a" / "ckpt").read_bytes()[len(OBJECT_MAGIC) :]
    assert b'"writer": "dep-a"' in stored  # signed by the pod, checked by your machine:
    assert codec.loads(signer.verify("dep-a/ckpt", stored)) == {"step": 3}
    assert kt.get("datasets/mnist") == [1, 2]  # shared with it, written by your machine
    with pytest.raises(DataStoreError, match="may not read key 'dep-b/weights'"):
        kt.get("dep-b/weights")
    with pytest.raises(DataStoreError, match="may not write"):
        kt.put("datasets/mnist", [666])
    (tmp_path / "f").write_bytes(b"f" * (24 << 20))  # more than the sockets buffer
    with pytest.raises(DataStoreError, match="may not write key 'datasets/f'"):
        kt.put("datasets/f", tmp_path / "f")  # a file: refused by the store itself
    with pytest.raises(DataStoreError, match="may not write key 'dep-b'"):
        kt.rm("dep-b", recursive=True)
    with pytest.raises(DataStoreError, match="may not read the store's root"):
        kt.ls()
    with pytest.raises(DataStoreError, match="may not write the store's root"):
        wipe()
    assert user.ls("dep-b", False)[0]["key"] == "dep-b/weights"  # all still there
    user.close()


# ---- signed objects ---------------------------------------------------------------------------------


class Planted:
    """A pickle that makes a directory when it is unpickled: the proof that it ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def test_get_refuses_a_planted_or_forged_object_before_unpickling_it(
    server: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the store server: an object written straight to the store's disk (unsigned), one
    signed by another deployment's keys in dep-a's name, and a valid one copied to another key
    are refused by your machine's kt.get and by dep-a's pods, and never unpickled."""
    ran = tmp_path / "ran"
    pickle = codec.dumps(Planted(str(ran)))
    dep_b = Signer.from_handoff("dep-b", Signer.full(server.token).handed(["dep-b"]), ["dep-b"])
    # dep-b's pods hold K("dep-b") only: they sign in dep-a's name with the key they have
    forged = Signer("dep-a", {"dep-a": dep_b.keys["dep-b"]}, ("dep-a",)).sign(
        "dep-a/forged", pickle
    )
    good = Signer.full(server.token).sign("dep-a/good", codec.dumps("fine"))
    data = server.root / "data" / "dep-a"
    data.mkdir(parents=True)
    (data / "unsigned").write_bytes(OBJECT_MAGIC + pickle)
    (data / "forged").write_bytes(OBJECT_MAGIC + forged)
    (data / "good").write_bytes(OBJECT_MAGIC + good)
    (data / "copied").write_bytes(OBJECT_MAGIC + good)
    info = location.handoff(_StoreBackend(server.url, server.token), "dep-a")
    assert info is not None
    _as_pod(monkeypatch, tmp_path, info)
    assert kt.get("dep-a/good") == "fine"
    for key, why in (
        ("dep-a/unsigned", "it carries no signature"),
        (
            "dep-a/forged",
            "signature (writer 'dep-a', signed with the key of prefix 'dep-a') does not match",
        ),
        (
            "dep-a/copied",
            "signature (writer 'your machine', signed with the key of prefix '') does not match",
        ),
    ):
        with pytest.raises(DataStoreError, match=re.escape(why)) as err:
            kt.get(key)
        assert f"refused to unpickle key {key!r}" in str(err.value) and err.value.key == key
        stored = (server.root / "data" / key).read_bytes()[len(OBJECT_MAGIC) :]
        with pytest.raises(DataStoreError, match=re.escape(why)):  # as your machine checks it
            Signer.full(server.token).verify(key, stored)
    assert not ran.exists(), "a refused pickle ran"


def test_the_local_store_signs_its_objects_and_refuses_planted_ones(
    home: Path, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    kt.put("runs/cfg", {"lr": 0.1})
    root = home / "store" / "default"
    stored = (root / "data" / "runs" / "cfg").read_bytes()
    assert stored.startswith(OBJECT_MAGIC + b"KTLITE-SIG-1\n")
    assert oct((root / "signing.key").stat().st_mode & 0o777) == "0o600"
    assert kt.get("runs/cfg") == {"lr": 0.1}
    (root / "data" / "runs" / "evil").write_bytes(OBJECT_MAGIC + codec.dumps(Planted(str(ran))))
    with pytest.raises(
        DataStoreError, match="refused to unpickle key 'runs/evil': it carries no signature"
    ):
        kt.get("runs/evil")
    (root / "data" / "runs" / "moved").write_bytes(stored)  # a signed object under another key
    with pytest.raises(
        DataStoreError, match="refused to unpickle key 'runs/moved'.*does not match"
    ):
        kt.get("runs/moved")
    assert not ran.exists()


def test_store_access_is_checked_at_construction_and_does_not_reshape_the_pods() -> None:
    from ktlite.specs.deployment_spec import DeploymentSpec

    compute = kt.Compute(backend="kubernetes", store_access={"datasets/": "read", "out": "write"})
    assert compute.kubernetes.store_access == (("datasets", "read"), ("out", "write"))
    listed = kt.Compute(backend="kubernetes", store_access=["datasets", "b"])
    assert listed.kubernetes.store_access == (("b", "read"), ("datasets", "read"))
    for bad, why in (
        ({"": "read"}, "cannot grant the data store's root"),
        (["/"], "cannot grant the data store's root"),
        ({"a": "admin"}, "store_access\\['a'\\]='admin'; allowed: 'read', 'write'"),
        ({"a/../b": "read"}, "not a valid data store key"),
        ("datasets", "must map data store prefixes"),
    ):
        with pytest.raises(ConfigError, match=why):
            kt.Compute(backend="kubernetes", store_access=bad)
    plain = DeploymentSpec("d", pod=kt.Compute(backend="kubernetes").pod_spec())
    shared = DeploymentSpec("d", pod=compute.pod_spec())
    assert plain.pod_hash() == shared.pod_hash()  # a grant travels with the code, not the pods


# ---- a cap on what the store holds --------------------------------------------------------------

CAP = 1000  # KTLITE_STORE_MAX_BYTES of the stores below


def _left_behind(root: Path) -> list[str]:
    return [p.name for p in (root / "tmp").iterdir()]


def test_the_store_server_refuses_an_upload_over_its_cap_before_and_while_it_streams(
    tmp_path: Path,
) -> None:
    with store_server(tmp_path, KTLITE_STORE_MAX_BYTES=str(CAP)) as server:
        url, auth = f"{server.url}/store/v1/key", _auth(server.token)
        assert httpx.put(url, params={"key": "a"}, content=b"a" * 600, headers=auth).is_success
        # declared: refused before its body is read
        resp = httpx.put(url, params={"key": "b"}, content=b"b" * 600, headers=auth)
        assert _status(resp) == (507, "store_full"), resp.text
        detail = resp.json()["detail"]
        assert "storing 'b' (600 bytes) on top of the 600 bytes it holds" in detail
        assert f"cap of {CAP} bytes (KTLITE_STORE_MAX_BYTES)" in detail, detail

        # chunked, declaring nothing: refused once what arrived goes over
        def chunks() -> Iterator[bytes]:
            yield from (b"c" * 150 for _ in range(4))

        resp = httpx.put(url, params={"key": "c"}, content=chunks(), headers=auth)
        assert _status(resp) == (507, "store_full") and "so far" in resp.json()["detail"]
        tar_size, tar = tar_stream(_small_tree(tmp_path / "tree"))
        assert tar_size > CAP - 600
        resp = httpx.put(url, params={"key": "d", "kind": "dir"}, content=iter(tar), headers=auth)
        assert _status(resp) == (507, "store_full"), resp.text
        keys = [e["key"] for e in httpx.get(f"{server.url}/store/v1/ls", headers=auth).json()]
        assert keys == ["a"] and _left_behind(server.root) == []
        assert httpx.put(url, params={"key": "e"}, content=b"e" * 400, headers=auth).is_success
        # the total follows what the store holds: a replaced value, a removal, a wipe
        assert (
            _status(httpx.put(url, params={"key": "a"}, content=b"A" * 600, headers=auth))[0] == 200
        )
        assert (
            _status(httpx.put(url, params={"key": "f"}, content=b"f" * 1, headers=auth))[0] == 507
        )
        assert httpx.delete(url, params={"key": "e"}, headers=auth).is_success
        assert httpx.put(url, params={"key": "f"}, content=b"f" * 400, headers=auth).is_success
        assert httpx.post(f"{server.url}/store/v1/wipe", headers=auth).is_success
        assert httpx.put(url, params={"key": "g"}, content=b"g" * CAP, headers=auth).is_success
        assert _left_behind(server.root) == []


def _small_tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"f" * 300)
    return root


def test_the_local_store_applies_the_same_cap(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KTLITE_STORE_MAX_BYTES", str(CAP))
    (tmp_path / "f").write_bytes(b"x" * 600)
    kt.put("f", tmp_path / "f")
    kt.put("f", tmp_path / "f")  # a replaced value frees its bytes
    with pytest.raises(DataStoreError, match=f"cap of {CAP} bytes \\(KTLITE_STORE_MAX_BYTES\\)"):
        kt.put("g", tmp_path / "f")
    with pytest.raises(DataStoreError, match="KTLITE_STORE_MAX_BYTES"):
        kt.put("t", _small_tree(tmp_path / "tree"))
    with pytest.raises(DataStoreError, match="KTLITE_STORE_MAX_BYTES"):
        kt.put("o", data="o" * 600)
    assert [e["key"] for e in kt.ls()] == ["f"]
    assert _left_behind(home / "store" / "default") == []
    monkeypatch.setenv("KTLITE_STORE_MAX_BYTES", "lots")
    with pytest.raises(ConfigError, match="KTLITE_STORE_MAX_BYTES='lots': must be a positive"):
        kt.put("h", 1)
