"""The data store on the local backend (``kt.put/get/ls/rm``): key rules (pure), then real
files in ``$KTLITE_HOME/store/<namespace>``, real rank processes of a deployed ``kt.fn``
using the same store, a directory round trip, a >8 MB file, concurrent writers and readers,
and the store server of the Kubernetes backend served for real by uvicorn (its HTTP client
against it, through the same code a pod uses)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.datastore import store as store_module
from ktlite.datastore.location import handoff
from ktlite.datastore.storedir import (
    OBJECT_MAGIC,
    StoreDir,
    address_file,
    check_key,
    extract,
    tar_stream,
)
from ktlite.errors import AuthError, ConfigError, DataStoreError
from ktlite.net.progress import Progress

# ---- keys (pure) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["a", "a/b", "datasets/mnist/train", "a-b_c.d", "x/"])
def test_valid_keys(key: str) -> None:
    assert check_key(key) == key.rstrip("/")


@pytest.mark.parametrize(
    "key,why",
    [
        ("", "empty"),
        ("/abs", "absolute"),
        ("a//b", "empty segment"),
        ("a/../b", "'..'"),
        ("..", "'..'"),
        ("./a", "'.'"),
        ("a\\b", "backslash"),
        ("a" * 1025, "longer than"),
    ],
)
def test_invalid_keys_name_the_problem(key: str, why: str) -> None:
    with pytest.raises(ConfigError, match="not a valid data store key") as err:
        check_key(key)
    assert why in str(err.value)
    assert "e.g. 'datasets/mnist'" in str(err.value)


def test_non_string_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="string"):
        check_key(3)


def test_root_is_only_a_prefix() -> None:
    assert check_key("", allow_root=True) == ""
    with pytest.raises(ConfigError):
        check_key("")


def test_address_file_sits_next_to_the_pod_ips_file() -> None:
    assert address_file("/tmp/ktlite-pod-ips-12.json") == "/tmp/ktlite-store-12.json"


def test_tar_stream_size_is_exact_and_extracts_back(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    size, chunks = tar_stream(src)
    data = b"".join(chunks)
    assert len(data) == size
    extract(io.BytesIO(data), tmp_path / "out")
    assert _digest(tmp_path / "out") == _digest(src)


def test_extract_refuses_paths_outside_the_directory(tmp_path: Path) -> None:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    buf.seek(0)
    with pytest.raises(DataStoreError, match="not a plain relative path"):
        extract(buf, tmp_path / "out")
    assert not (tmp_path / "escape").exists()


def test_progress_is_quiet_unless_a_tty_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    p = Progress("put x", 100 << 20, out=out)
    p.add(100 << 20)
    p.close()
    assert out.getvalue() == ""  # not a terminal
    monkeypatch.setenv("KTLITE_PROGRESS", "1")
    p = Progress("put x", 100 << 20, out=out)
    for _ in range(4):
        p.add(25 << 20)
    p.close()
    assert "put x" in out.getvalue() and "100.0%" in out.getvalue()


# ---- the local store, in this process -------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KTLITE_NAMESPACE", raising=False)
    monkeypatch.delenv("KTLITE_STORE_HOME", raising=False)
    monkeypatch.delenv("KTLITE_STORE_NAMESPACE", raising=False)
    monkeypatch.delenv("KTLITE_BACKEND", raising=False)
    return tmp_path / "home"


def _tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(70_000))
    (root / "sub" / "deeper" / "c").write_bytes(b"")
    (root / "empty").mkdir()
    return root


def _digest(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_directory_round_trip(home: Path, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    kt.put("sets/tree", src)
    assert (
        home / "store" / "default" / "data" / "sets" / "tree" / "a.txt"
    ).read_text() == "alpha\n"
    out = kt.get("sets/tree", tmp_path / "out")
    assert out == tmp_path / "out"
    assert _digest(out) == _digest(src)
    # into an existing directory: merged, same-named files replaced
    (tmp_path / "out" / "a.txt").write_text("old")
    (tmp_path / "out" / "mine").write_text("kept")
    kt.get("sets/tree", tmp_path / "out")
    assert (tmp_path / "out" / "a.txt").read_text() == "alpha\n"
    assert (tmp_path / "out" / "mine").read_text() == "kept"


def test_file_get_without_dest_goes_to_the_current_directory(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f.txt").write_text("hello")
    kt.put("docs/f.txt", str(tmp_path / "f.txt"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert kt.get("docs/f.txt") == work / "f.txt"
    assert (work / "f.txt").read_text() == "hello"
    (work / "into").mkdir()
    assert kt.get("docs/f.txt", work / "into") == work / "into" / "f.txt"


def test_objects_by_value(home: Path) -> None:
    np = pytest.importorskip("numpy")
    kt.put("runs/1/config", {"lr": 0.1, "layers": [1, 2]})
    kt.put("runs/1/weights", np.arange(12.0).reshape(3, 4))
    kt.put("runs/1/note", data="not a path")
    assert kt.get("runs/1/config") == {"lr": 0.1, "layers": [1, 2]}
    assert (kt.get("runs/1/weights") == np.arange(12.0).reshape(3, 4)).all()
    assert kt.get("runs/1/note") == "not a path"
    with pytest.raises(ConfigError, match="holds a Python object"):
        kt.get("runs/1/config", "somewhere")


def test_kubetorch_keywords_are_accepted(home: Path, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    kt.put(key="k/f", src=str(tmp_path / "f"), locale="store", force=True, verbose=True)
    assert kt.get(key="k/f", dest=tmp_path / "g", force=True, verbose=True).read_text() == "x"
    assert [e["key"] for e in kt.ls(key="k", verbose=True)] == ["k/f"]
    with pytest.raises(ConfigError, match="locale='local' is not supported"):
        kt.put("k/f", str(tmp_path / "f"), locale="local")
    kt.rm(key="k", recursive=True, verbose=True)
    assert kt.ls() == []


def test_a_string_src_must_be_a_path(home: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or directory; to store a string"):
        kt.put("k", "/no/such/path")
    with pytest.raises(ConfigError, match="exactly one"):
        kt.put("k")
    with pytest.raises(ConfigError, match="exactly one"):
        kt.put("k", 1, data=2)


def test_ls_lists_children_with_type_and_size(home: Path, tmp_path: Path) -> None:
    assert kt.ls() == []
    (tmp_path / "f").write_bytes(b"12345")
    kt.put("a/f", tmp_path / "f")
    kt.put("a/o", 7)
    kt.put("a/d", _tree(tmp_path / "t"))
    rows = {e["name"]: e for e in kt.ls("a")}
    assert set(rows) == {"f", "o", "d/"}
    assert rows["f"]["type"] == "file" and rows["f"]["size"] == 5 and not rows["f"]["is_directory"]
    assert rows["o"]["type"] == "object"
    assert (
        rows["d/"]["type"] == "dir" and rows["d/"]["is_directory"] and rows["d/"]["size"] == 70_006
    )
    assert [e["key"] for e in kt.ls(key="a/f")] == ["a/f"]  # Kubetorch's keyword
    deep = [e["key"] for e in kt.ls("a", recursive=True)]
    assert deep == ["a/d/a.txt", "a/d/sub/b.bin", "a/d/sub/deeper/c", "a/f", "a/o"]
    assert [e["key"] for e in kt.ls()] == ["a"]


def test_rm_and_missing_keys(home: Path, tmp_path: Path) -> None:
    kt.put("x/y/z", 1)
    kt.put("x/w", 2)
    with pytest.raises(DataStoreError, match="is a directory; pass recursive=True"):
        kt.rm("x")
    kt.rm("x/w")
    with pytest.raises(DataStoreError, match="no key 'x/w'") as err:
        kt.get("x/w")
    assert err.value.key == "x/w"
    with pytest.raises(DataStoreError, match="no key 'x/w'"):
        kt.rm("x/w")
    with pytest.raises(DataStoreError, match="no key 'nope'"):
        kt.ls("nope")
    kt.rm("x", recursive=True)
    assert kt.ls() == []
    kt.put("q", 1)
    kt.put("r/s", 1)
    kt.rm("r", recursive=True)
    assert [e["key"] for e in kt.ls()] == ["q"]


def test_a_file_cannot_hold_keys(home: Path) -> None:
    kt.put("leaf", 1)
    with pytest.raises(DataStoreError, match="key 'leaf' holds a file"):
        kt.put("leaf/child", 2)


def test_namespaces_are_separate_directories(home: Path) -> None:
    kt.put("k", data="A", namespace="team-a")
    kt.put("k", data="B", namespace="team-b")
    assert kt.get("k", namespace="team-a") == "A"
    assert kt.get("k", namespace="team-b") == "B"
    with pytest.raises(DataStoreError):
        kt.get("k")
    assert (home / "store" / "team-a" / "data" / "k").read_bytes().startswith(OBJECT_MAGIC)


def test_large_file_streams_and_no_partial_file_is_ever_seen(home: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(1 << 20))
    want = hashlib.sha256(big.read_bytes()).hexdigest()
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:  # every complete look at the key has all 12 MB or nothing
        target = home / "store" / "default" / "data" / "big"
        while not stop.is_set():
            with open(target, "rb") if target.exists() else open(os.devnull, "rb") as f:
                seen.append(len(f.read()))

    kt.put("big", big)
    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(3):
            kt.put("big", big)
    finally:
        stop.set()
        t.join()
    assert set(seen) == {12 << 20}
    out = kt.get("big", tmp_path / "copy.bin")
    assert hashlib.sha256(out.read_bytes()).hexdigest() == want
    assert not list((home / "store" / "default" / "tmp").iterdir())  # nothing left staged


def test_concurrent_puts_and_gets(home: Path, tmp_path: Path) -> None:
    payloads = {i: os.urandom(300_000 + i) for i in range(6)}
    for i, data in payloads.items():
        (tmp_path / f"p{i}").write_bytes(data)

    def put(i: int) -> None:
        kt.put("shared", tmp_path / f"p{i}")
        kt.put(f"own/{i}", {"i": i})

    def get(i: int) -> bytes:
        return kt.get("shared", tmp_path / f"got{i}").read_bytes()

    kt.put("shared", tmp_path / "p0")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(put, i) for i in payloads] + [pool.submit(get, i) for i in payloads]
        results = [f.result() for f in futures]
    got = [r for r in results if r is not None]
    assert got and all(g in payloads.values() for g in got)  # whole values only
    assert kt.get("shared", tmp_path / "last").read_bytes() in payloads.values()
    assert [kt.get(f"own/{i}") for i in payloads] == [{"i": i} for i in payloads]


def test_concurrent_processes_write_one_key(home: Path) -> None:
    code = (
        "import sys, ktlite as kt\nfor _ in range(20): kt.put('race', data=sys.argv[1] * 100_000)\n"
    )
    kt.put("race", data="z" * 100_000)
    env = {**os.environ, "KTLITE_HOME": str(home)}
    procs = [subprocess.Popen([sys.executable, "-c", code, c], env=env) for c in "abc"]
    values = set()
    try:
        while any(p.poll() is None for p in procs):
            values.add(kt.get("race"))  # the key always holds one whole value
    finally:
        codes = [p.wait(60) for p in procs]
    assert codes == [0, 0, 0]
    assert values <= {c * 100_000 for c in "abcz"}
    assert kt.get("race") in {c * 100_000 for c in "abc"}


# ---- from inside real rank processes ----------------------------------------------------------------


def _rank_puts_and_gets(tag: str) -> dict[str, object]:
    import os

    import ktlite as kt

    rank = int(os.environ["RANK"])
    kt.put(f"{tag}/from-rank-{rank}", {"rank": rank})
    seen = kt.get(f"{tag}/from-caller")
    out = kt.get(f"{tag}/dir", f"/tmp/{tag}-rank-{rank}")
    return {
        "rank": rank,
        "seen": seen,
        "files": sorted(p.name for p in out.iterdir()),
        "home": os.environ.get("KTLITE_STORE_HOME"),
    }


@pytest.mark.timeout(120)
def test_ranks_of_a_deployed_fn_share_the_callers_store(home: Path, tmp_path: Path) -> None:
    tag = f"t{uuid.uuid4().hex[:6]}"
    kt.put(f"{tag}/from-caller", [1, 2, 3])
    kt.put(f"{tag}/dir", _tree(tmp_path / "src"))
    remote = kt.fn(_rank_puts_and_gets, name=f"store-{tag}").to(
        kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1)
    )
    try:
        results = remote(tag)
    finally:
        remote.teardown()
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["seen"] == [1, 2, 3] for r in results)
    assert all(r["files"] == ["a.txt", "empty", "sub"] for r in results)
    assert all(r["home"] == str(home) for r in results)
    assert kt.get(f"{tag}/from-rank-0") == {"rank": 0}
    assert kt.get(f"{tag}/from-rank-1") == {"rank": 1}


def _rank_puts(tag: str) -> str:
    import os

    import ktlite as kt

    kt.put(f"{tag}/r{os.environ['RANK']}", data="x")
    return os.environ.get("KTLITE_STORE_NAMESPACE", "")


@pytest.mark.timeout(120)
def test_ranks_use_their_deployments_namespace(home: Path) -> None:
    tag = f"t{uuid.uuid4().hex[:6]}"
    remote = kt.fn(_rank_puts, name=f"store-ns-{tag}").to(kt.Compute(cpus=1, namespace="team-x"))
    try:
        assert remote(tag) == "team-x"
    finally:
        remote.teardown()
    assert kt.get(f"{tag}/r0", namespace="team-x") == "x"
    with pytest.raises(DataStoreError, match="no key"):
        kt.get(f"{tag}/r0")


def test_a_broken_directory_upload_leaves_nothing(store_server: str, tmp_path: Path) -> None:
    """The store server unpacks a directory while it arrives; a stream that breaks leaves the
    old value and no staged files, and the server is not stuck waiting for the rest."""
    import httpx

    auth = {"x-ktlite-token": "Bearer store-secret"}
    httpx.put(f"{store_server}/store/v1/key", params={"key": "d"}, content=b"old", headers=auth)
    _, chunks = tar_stream(_tree(tmp_path / "src"))

    def broken() -> Iterator[bytes]:
        for i, chunk in enumerate(chunks):
            if i == 3:
                raise OSError("connection lost")
            yield chunk

    with pytest.raises(OSError):
        httpx.put(
            f"{store_server}/store/v1/key",
            params={"key": "d", "kind": "dir"},
            content=broken(),
            headers=auth,
        )
    t0 = time.monotonic()
    assert (
        httpx.get(f"{store_server}/store/v1/key", params={"key": "d"}, headers=auth).content
        == b"old"
    )
    deadline = time.monotonic() + 10
    while list((tmp_path / "pvc" / "tmp").iterdir()):  # the server cleans up when it sees the break
        assert time.monotonic() < deadline, list((tmp_path / "pvc" / "tmp").iterdir())
        time.sleep(0.05)
    assert time.monotonic() - t0 < 10


# ---- the store server (the Kubernetes store pod's), served for real ----------------------------------


def _black_hole(ip: str) -> tuple[socket.socket, socket.socket]:
    """A listener that never accepts, its one-slot backlog taken: the kernel drops new SYNs."""
    hole = socket.socket()
    hole.bind((ip, 0))
    hole.listen(0)
    filler = socket.socket()
    filler.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        filler.connect(hole.getsockname())
    return hole, filler


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[str]:
    """``python -m ktlite_server`` in store mode on a free port: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready.json"
    env = {**os.environ, "KTLITE_STORE_ROOT": str(tmp_path / "pvc"), "KTLITE_TOKEN": "store-secret"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ready-file",
            str(ready),
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the store server did not start"
            )
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


class _StoreBackend:
    """What a Kubernetes backend reports of the namespace's store (its master token)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def store_handoff(self) -> dict[str, str]:
        return {
            "url": self.url,
            "token": self.token,
            "pod": "ktlite-store-0",
            "namespace": "default",
        }


def test_store_server_round_trips_through_the_pod_client(
    store_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a rank on a Kubernetes pod: the address its pod server was handed, next to its peer list
    ips = tmp_path / "ktlite-pod-ips-1.json"
    monkeypatch.setenv("KTLITE_POD_IPS_FILE", str(ips))
    monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
    monkeypatch.setenv("KTLITE_NAMESPACE", "default")
    with pytest.raises(DataStoreError, match="knows of no data store.*call .to\\(\\) again"):
        kt.put("k", 1)
    from ktlite_server.store import remember

    remember(handoff(_StoreBackend(store_server, "store-secret"), "m"), str(ips))
    assert oct(os.stat(address_file(str(ips))).st_mode & 0o777) == "0o600"
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 << 20))
    kt.put("m/big", big)
    kt.put("m/tree", _tree(tmp_path / "src"))
    kt.put("m/obj", {"x": 1})
    assert kt.get("m/obj") == {"x": 1}
    assert kt.get("m/big", tmp_path / "big.out").read_bytes() == big.read_bytes()
    assert _digest(kt.get("m/tree", tmp_path / "tree.out")) == _digest(tmp_path / "src")
    assert {e["name"] for e in kt.ls("m")} == {"big", "tree/", "obj"}
    with pytest.raises(DataStoreError, match="no key 'm/nope'"):
        kt.get("m/nope")
    with pytest.raises(DataStoreError, match="pass recursive=True"):
        kt.rm("m/tree")
    kt.rm("m", recursive=True)
    with pytest.raises(DataStoreError, match="no key 'm'"):
        kt.ls("m")
    with pytest.raises(ConfigError, match="not a valid data store key"):
        kt.get("a//b")
    # a wrong token, and an address that swallows packets, are named
    remember({"url": store_server, "token": "wrong", "pod": "ktlite-store-0"}, str(ips))
    with pytest.raises(AuthError, match="refused the store token") as err:
        kt.ls()
    assert "wrong" not in str(err.value)
    hole, filler = _black_hole("127.0.0.77")  # a replaced pod's old IP: SYNs are dropped
    try:
        url = f"http://127.0.0.77:{hole.getsockname()[1]}"
        remember({"url": url, "token": "store-secret", "pod": "ktlite-store-0"}, str(ips))
        t0 = time.monotonic()
        with pytest.raises(
            DataStoreError, match="127.0.0.77.*no connection within.*new IP: call \\.to\\(\\) again"
        ):
            kt.ls()
        assert time.monotonic() - t0 < 20
    finally:
        hole.close()
        filler.close()
    remember({"url": None}, str(ips))
    assert not os.path.exists(address_file(str(ips)))


def test_store_server_refuses_without_the_token(store_server: str) -> None:
    import httpx

    assert httpx.get(f"{store_server}/health").status_code == 200
    for method, path in (
        ("GET", "/store/v1/ls"),
        ("GET", "/store/v1/key?key=a"),
        ("PUT", "/store/v1/key?key=a"),
        ("DELETE", "/store/v1/key?key=a"),
    ):
        assert httpx.request(method, store_server + path).status_code == 401


def test_store_dir_survives_a_broken_upload(tmp_path: Path) -> None:
    store = StoreDir(tmp_path / "s")
    store.write("k", [b"good"])

    def broken() -> Iterator[bytes]:
        yield b"half"
        raise OSError("connection lost")

    with pytest.raises(OSError):
        store.write("k", broken())
    f, entry = store.open("k")
    with f:
        assert f.read() == b"good"
    assert not list(store.tmp.iterdir())


def test_store_module_exports() -> None:
    assert kt.put is store_module.put and kt.get is store_module.get
    assert kt.ls is store_module.ls and kt.rm is store_module.rm
    assert issubclass(kt.DataStoreError, kt.KtliteError)
