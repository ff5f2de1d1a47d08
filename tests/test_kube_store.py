"""The data store on Kubernetes, through the stand-in cluster.

First against the fake API server in-process (``kube_fake``, fake clock): the objects the
store is made of, creating it once, waiting for it with a bound, the errors of a claim that
never binds and of a pod that cannot start, teardown, and the hand-off to pods; the pod
proxy forwards to a real store server process. Then end to end on ``kube_harness`` (a fake
API server over real HTTP, a real server process behind every pod): ``kt.put`` from here
creates the store pod, ranks of a deployed ``kt.fn`` read and write it by pod IP, and a
replaced store pod is named by the ranks until ``.to()`` hands them its new address.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kube_fake as kf
import pytest
import server_procs
from kube_cluster import Cluster as StandIn
from kube_unit import isolate_backend

import ktlite as kt
from ktlite.backends import kube_deps
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_store as ks
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.commands import cli
from ktlite.errors import DataStoreError

HERE = Path(__file__).parent
HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-store"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_backend(monkeypatch, tmp_path)
    for env in (
        "KTLITE_STORE_SIZE",
        "KTLITE_STORE_STORAGE_CLASS",
        "KTLITE_STORE_TIMEOUT",
        "KTLITE_POD_IPS_FILE",
    ):
        monkeypatch.delenv(env, raising=False)


# ---- the objects (pure) ------------------------------------------------------------------------


def test_render_names_objects_and_keeps_the_token_out_of_the_plan() -> None:
    objs = ks.render(
        "team",
        image="img:1",
        install="ktlite==0.1.0",
        token=None,
        size="5Gi",
        storage_class="fast",
        pull_policy="Never",
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Secret", "ktlite-store-token"),
        ("PersistentVolumeClaim", "ktlite-store"),
        ("StatefulSet", "ktlite-store"),
    ]
    secret, claim, sts = objs
    assert secret["stringData"]["token"] == km.TOKEN_PLACEHOLDER
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "fast",
    }
    for obj in objs:
        labels = obj["metadata"]["labels"]
        assert labels[ks.LABEL] == ks.NAME
        # not a deployment: `ktlite list` and `ktlite teardown --all` must not find it
        assert km.NAME_LABEL not in labels and "app.kubernetes.io/managed-by" not in labels
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert "KTLITE_TOKEN" not in env  # a file of the Secret: /proc/1/environ shows no env var
    assert env["KTLITE_TOKEN_FILE"]["value"] == "/var/run/ktlite/token/token"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ktlite-token"]["secret"]["secretName"] == "ktlite-store-token"
    assert env["KTLITE_STORE_ROOT"]["value"] == ks.ROOT
    assert env["KTLITE_STORE_MAX_BYTES"]["value"] == str(5 << 30)  # the claim's size
    capped = ks.render("team", image="i", install="k", token=None, max_bytes=1000)[2]
    capped_env = capped["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KTLITE_STORE_MAX_BYTES", "value": "1000"} in capped_env
    assert container["imagePullPolicy"] == "Never" and container["image"] == "img:1"
    assert {"name": "data", "mountPath": ks.ROOT} in container["volumeMounts"]
    assert sts["spec"]["replicas"] == 1


# ---- against the fake API server ------------------------------------------------------------------


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[str]:
    """A real store server (``python -m ktlite_server`` with KTLITE_STORE_ROOT): what the
    store pod runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready.json"
    proc = None

    def start(token: str) -> str:
        nonlocal proc
        env = {**os.environ, "KTLITE_STORE_ROOT": str(tmp_path / "pvc"), "KTLITE_TOKEN": token}
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
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the store server did not start"
            )
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    yield start  # type: ignore[misc]
    if proc is not None:
        proc.terminate()
        proc.wait(10)


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``) with the data store's objects, and the clients
    it opened (closed with it)."""

    api_token = API_TOKEN
    context = "fake"

    def __init__(self, behavior: kf.PodBehavior | None = None, **options: Any) -> None:
        super().__init__(behavior, **options)
        self.store = ks.KubeStore(self.backend)
        self.clients = [self.http]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def names(self, kind: str) -> list[str]:
        """The names of ``kind`` there, but the namespace's shared cache of the server's
        packages (``kube_deps``)."""
        return sorted(
            o["metadata"]["name"]
            for o in self.fake.objects(kind)
            if kube_deps.DEPS_LABEL not in (o["metadata"].get("labels") or {})
        )

    def token(self) -> str:
        secret = self.fake.get("secrets", "default", ks.SECRET)
        assert secret is not None
        return base64.b64decode(secret["data"]["token"]).decode()

    def serve(self, start: Callable[[str], str]) -> None:
        """The store pod's port forwards to a real store server, started on first use with
        the token of the store's Secret (as the pod's env has it)."""
        forward = httpx.Client(timeout=30)
        self.clients.append(forward)
        url: list[str] = []

        def handler(request: httpx.Request) -> httpx.Response:
            if not url:
                url.append(start(self.token()))
            target = httpx.URL(url[0]).copy_with(path=request.url.path, query=request.url.query)
            return forward.send(
                httpx.Request(
                    request.method, target, headers=request.headers, content=request.content
                ),
                stream=True,
            )

        self.fake.proxy_handlers[(ks.POD, km.SERVER_PORT)] = handler


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(behavior: kf.PodBehavior | None = None, **options: Any) -> Cluster:
        made.append(Cluster(behavior, **options))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch) -> Cluster:
    c = make_cluster()
    monkeypatch.setattr(
        KubernetesBackend, "shared", classmethod(lambda cls, namespace=None: c.backend)
    )
    return c


def test_first_put_creates_the_store_and_everything_goes_through_the_pod_proxy(
    cluster: Cluster, store_server: Callable[[str], str], tmp_path: Path
) -> None:
    assert kt.ls(backend="kubernetes") == []  # no store: nothing listed, nothing created
    with pytest.raises(
        DataStoreError, match="no data store in namespace 'default' yet: kt.put creates it"
    ):
        kt.get("k", backend="kubernetes")
    assert cluster.names("statefulsets") == [] and cluster.names("persistentvolumeclaims") == []
    cluster.serve(store_server)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 << 20))
    kt.put("data/big", big, backend="kubernetes")
    assert cluster.names("statefulsets") == ["ktlite-store"]
    assert cluster.names("persistentvolumeclaims") == ["ktlite-store"]
    assert cluster.names("secrets") == ["ktlite-store-token"]
    assert "creating the data store in namespace 'default'" in cluster.out.getvalue()
    since = len(cluster.fake.requests)
    kt.put("data/obj", {"a": 1}, backend="kubernetes")
    assert not [
        r for r in cluster.fake.requests[since:] if r.method == "POST" and "/proxy" not in r.path
    ]
    assert kt.get("data/obj", backend="kubernetes") == {"a": 1}
    out = kt.get("data/big", tmp_path / "out.bin", backend="kubernetes")
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(big.read_bytes()).digest()
    assert {e["name"] for e in kt.ls("data", backend="kubernetes")} == {"big", "obj"}
    kt.rm("data", recursive=True, backend="kubernetes")
    assert kt.ls(backend="kubernetes") == []
    # every store request went through the API server's pod proxy, with the store token
    proxied = [r for r in cluster.fake.requests if "/proxy/store/v1/" in r.path]
    assert proxied and all(
        r.headers.get("x-ktlite-token") == f"Bearer {cluster.token()}" for r in proxied
    )
    assert cluster.token() not in cluster.out.getvalue()


def test_ensure_is_idempotent_and_hands_off_the_pod_ip(
    cluster: Cluster, store_server: Callable[[str], str]
) -> None:
    assert ks.handoff(cluster.backend) == {"url": None, "namespace": "default"}
    cluster.serve(store_server)
    first = cluster.store.ensure(timeout=30)
    since = len(cluster.fake.requests)
    second = cluster.store.ensure(timeout=30)
    assert [r for r in cluster.fake.requests[since:] if r.method != "GET"] == []
    assert first == second
    assert first.token not in repr(first)
    ip = cluster.fake.get("pods", "default", ks.POD)["status"]["podIP"]  # type: ignore[index]
    info = ks.handoff(cluster.backend)
    assert info == {
        "url": f"http://{ip}:{km.SERVER_PORT}",
        "token": cluster.token(),
        "pod": ks.POD,
        "namespace": "default",
    }


def test_a_claim_that_never_binds_is_named(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KTLITE_STORE_STORAGE_CLASS", "does-not-exist-sc")
    with pytest.raises(DataStoreError) as err:
        cluster.store.ensure(timeout=60)
    text = str(err.value)
    assert "PersistentVolumeClaim 'ktlite-store'" in text and "ProvisioningFailed" in text
    assert "KTLITE_STORE_STORAGE_CLASS" in text
    assert cluster.clock() < 30  # failed early, not at the timeout


def test_a_claim_still_pending_at_the_timeout_is_named(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(pvc_bind_seconds=10_000)
    with pytest.raises(
        DataStoreError,
        match="PersistentVolumeClaim 'ktlite-store' in namespace 'default' "
        "was not bound after 20s.*describe pvc ktlite-store",
    ):
        c.store.ensure(timeout=20)


def test_an_image_that_cannot_be_pulled_fails_early(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(lambda pod: [(0, kf.pending()), (2, kf.err_image_pull())])
    with pytest.raises(
        DataStoreError, match="the data store cannot start: pod ktlite-store-0.*ErrImagePull"
    ):
        c.store.ensure(timeout=300)
    assert c.clock() < 60


def test_a_store_server_that_exits_shows_its_log(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(
        lambda pod: [
            (0, kf.pending()),
            (
                2,
                kf.terminated_error(
                    exit_code=1, logs="OSError: [Errno 98] Address already in use\n"
                ),
            ),
        ]
    )
    with pytest.raises(
        DataStoreError,
        match="(?s)exited while starting.*last lines of its log:\n"
        "OSError: \\[Errno 98\\] Address already in use",
    ):
        c.store.ensure(timeout=300)


def test_a_pod_that_never_answers_times_out_saying_what_was_awaited(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()  # ready, but no server behind the proxy
    with pytest.raises(
        DataStoreError,
        match="pod ktlite-store-0 in namespace 'default' was not ready after "
        "15s.*kubectl -n default describe pod ktlite-store-0",
    ):
        c.store.ensure(timeout=15)


def test_teardown_of_a_deployment_leaves_the_store(
    cluster: Cluster, store_server: Callable[[str], str]
) -> None:
    cluster.serve(store_server)
    cluster.store.ensure(timeout=30)
    assert cluster.backend.list() == []  # the store is no deployment
    cluster.backend.teardown("ktlite-other")
    assert cluster.names("statefulsets") == ["ktlite-store"]
    assert cluster.store.teardown() is True
    assert cluster.names("statefulsets") == []
    # the data stays, and the key that signed its objects with it
    assert cluster.names("persistentvolumeclaims") == ["ktlite-store"]
    assert cluster.names("secrets") == ["ktlite-store-token"]
    assert cluster.store.teardown(volumes=True) is True
    assert cluster.names("persistentvolumeclaims") == [] and cluster.names("secrets") == []
    assert cluster.store.teardown() is False


def test_a_new_token_restarts_a_store_pod_that_kept_the_old_one(cluster: Cluster) -> None:
    cluster.fake.proxy_handlers[(ks.POD, km.SERVER_PORT)] = lambda r: httpx.Response(200, json={})
    cluster.store.ensure(timeout=30)
    uid = cluster.fake.get("pods", "default", ks.POD)["metadata"]["uid"]  # type: ignore[index]
    cluster.http.delete(f"/api/v1/namespaces/default/secrets/{ks.SECRET}")
    cluster.store.ensure(timeout=30)
    assert cluster.fake.get("pods", "default", ks.POD)["metadata"]["uid"] != uid  # type: ignore[index]


INSTALL_FAILED = (
    "ktlite: the image has no ktlite; installing ktlite==0.1.0\n"
    "ERROR: Could not find a version that satisfies the requirement ktlite==0.1.0\n"
    "ktlite: could not install ktlite==0.1.0\n"
)


def install_fails(pod: dict[str, Any]) -> kf.PodScript:
    """The default image without ktlite, on a cluster that cannot install it: the bootstrap
    exits 78, the kubelet restarts it, and it crash-loops (as on the real cluster)."""
    return [
        (0, kf.pending()),
        (2, kf.terminated_error(exit_code=km.SETUP_FAILED_EXIT, logs=INSTALL_FAILED)),
        (14, kf.crash_loop(exit_code=km.SETUP_FAILED_EXIT, logs=INSTALL_FAILED, restarts=1)),
    ]


def test_a_store_that_cannot_start_is_rolled_back_and_the_next_attempt_starts_afresh(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(install_fails, pod_termination_seconds=5)
    with pytest.raises(DataStoreError) as err:
        c.store.ensure(timeout=300)
    text = str(err.value)
    assert "the data store cannot start: pod ktlite-store-0" in text and "setup failed" in text
    assert "could not install ktlite==0.1.0" in text  # its log
    assert "ktlite store create --image IMAGE" in text  # the store's own fix, not a Compute's
    assert (
        "removed what this attempt created (Secret ktlite-store-token, PersistentVolumeClaim "
        "ktlite-store, StatefulSet ktlite-store)"
    ) in text
    assert c.clock() < 60  # failed early
    assert c.names("statefulsets") == [] and c.names("secrets") == []
    old = c.fake.get(
        "persistentvolumeclaims", "default", ks.CLAIM
    )  # Terminating until its pod has gone
    assert old is not None and old["metadata"].get("deletionTimestamp")
    # the next attempt (the image fixed) makes a new store instead of failing on the old one
    c.fake.pod_behavior = lambda pod: kf.ready()
    c.fake.proxy_handlers[(ks.POD, km.SERVER_PORT)] = lambda r: httpx.Response(200, json={})
    address = c.store.ensure(timeout=60)
    assert address.pod == ks.POD and c.names("statefulsets") == ["ktlite-store"]
    claim = c.fake.get("persistentvolumeclaims", "default", ks.CLAIM)
    assert claim is not None and not claim["metadata"].get("deletionTimestamp")
    assert (
        claim["metadata"]["uid"] != old["metadata"]["uid"]
    )  # a new claim, once the old one had gone


def test_a_failed_store_keeps_a_claim_from_before_and_names_the_commands_for_what_is_left(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.fake.pod_behavior = install_fails
    _, claim, _ = ks.render("default", image="img", install="ktlite", token=None)
    cluster.fake.create("persistentvolumeclaims", "default", claim)  # the store's data, from before
    command = "ktlite store teardown --backend kubernetes -n default"
    with pytest.raises(DataStoreError) as err:
        cluster.store.ensure(timeout=300)
    assert (
        "removed what this attempt created (Secret ktlite-store-token, StatefulSet ktlite-store); "
        "kept PersistentVolumeClaim 'ktlite-store', which holds the store's data from before: "
        f"`{command} --volumes` deletes it with that data"
    ) in str(err.value)
    assert cluster.names("statefulsets") == [] and cluster.names("secrets") == []
    kept = cluster.fake.get("persistentvolumeclaims", "default", ks.CLAIM)
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    # keep_failed=true keeps a failed store (for kubectl describe); the next attempt meets it
    monkeypatch.setenv("KTLITE_KEEP_FAILED", "true")
    with pytest.raises(
        DataStoreError,
        match=f"kept \\(keep_failed=true\\): Secret ktlite-store-token, "
        f"StatefulSet ktlite-store; `{command}` removes them",
    ):
        cluster.store.ensure(timeout=300)
    with pytest.raises(DataStoreError) as again:
        cluster.store.ensure(timeout=300)
    assert "setup failed" in str(again.value)
    assert (
        f"the data store from before is still there (StatefulSet ktlite-store, its pod, Secret "
        f"ktlite-store-token, PersistentVolumeClaim ktlite-store); `{command}` removes it and keeps "
        f"the data, `{command} --volumes` deletes the data too"
    ) in str(again.value)
    # the command it names removes what is left
    assert cli.main([*command.split()[1:], "--volumes", "-y"]) == 0
    assert [cluster.names(k) for k in ("statefulsets", "secrets", "pods")] == [[], [], []]
    assert cluster.fake.get("persistentvolumeclaims", "default", ks.CLAIM) is None


# ---- end to end on the stand-in cluster (real servers behind the pods) ------------------------------


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("the stand-in cluster's pods need root and unshare")
    with open(tmp_path / "harness.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kube_harness.py"), str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "KTLITE_HARNESS_PVC_BIND_S": "1.0"},
        )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "kubeconfig").exists():
            assert proc.poll() is None, (tmp_path / "harness.log").read_text()
            assert time.monotonic() < deadline, "the stand-in cluster did not start within 30 s"
            time.sleep(0.05)
        monkeypatch.setenv("KTLITE_KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
        monkeypatch.setenv("KTLITE_STORE_TIMEOUT", "60")
        yield tmp_path
    finally:
        for client, _ in KubernetesBackend._clients.values():  # what kt.put and .to() loaded
            client.close()
        server_procs.stop_group(proc)


def _in_rank(tag: str) -> dict[str, Any]:
    import os

    import ktlite as kt
    from ktlite.errors import DataStoreError

    rank = int(os.environ["RANK"])
    try:
        kt.put(f"{tag}/rank-{rank}", {"rank": rank})
        path = kt.get(f"{tag}/tree", f"/tmp/{tag}-{rank}")
        out = {
            "rank": rank,
            "config": kt.get(f"{tag}/config"),
            "files": sorted(p.name for p in path.iterdir()),
        }
    except DataStoreError as e:
        return {"rank": rank, "error": str(e)}
    try:  # its token reaches its grants only: never the root, nor another prefix
        kt.ls()
        out["root"] = "listed"
    except DataStoreError as e:
        out["root"] = str(e)
    try:
        kt.put("elsewhere/x", 1)
        out["elsewhere"] = "written"
    except DataStoreError as e:
        out["elsewhere"] = str(e)
    return out


@pytest.mark.timeout(240)
def test_pods_reach_the_store_by_ip_and_name_a_replaced_store(
    harness: Path, tmp_path: Path
) -> None:
    from ktlite.backends.kube_api import KubeApi, load

    tag = f"t{uuid.uuid4().hex[:6]}"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("A")
    (tree / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    kt.put(f"{tag}/config", {"lr": 0.5})
    kt.put(f"{tag}/tree", tree)
    closing: list[httpx.Client] = []
    remote = kt.fn(_in_rank, name=f"st-{tag}").to(
        kt.Compute(cpus=0.1, launch_timeout=120, store_access={tag: "write"}).distribute(
            "spmd", workers=2
        )
    )
    try:
        results = remote(tag)
        assert [r.get("error") for r in results] == [None, None]
        assert all(r["config"] == {"lr": 0.5} and r["files"] == ["a.txt", "sub"] for r in results)
        assert all("may not read the store's root" in r["root"] for r in results), results
        assert all("may not write 'elsewhere/x'" in r["elsewhere"] for r in results), results
        assert kt.get(f"{tag}/rank-1") == {"rank": 1}
        assert {e["name"] for e in kt.ls(tag)} == {"config", "tree/", "rank-0", "rank-1"}
        # the store pod is replaced: a new IP; the ranks still hold the old address
        http, info = load(str(harness / "kubeconfig"))
        closing.append(http)
        api = KubeApi(http, info.namespace)
        old_ip = api.get("Pod", ks.POD)["status"]["podIP"]  # type: ignore[index]
        api.delete("Pod", ks.POD)
        deadline = time.monotonic() + 60
        while True:
            pod = api.get("Pod", ks.POD)
            if (
                pod
                and (pod.get("status") or {}).get("podIP") not in (None, old_ip)
                and not pod["metadata"].get("deletionTimestamp")
            ):
                break
            assert time.monotonic() < deadline, "the store pod was not replaced"
            time.sleep(0.2)
        assert kt.get(f"{tag}/config") == {"lr": 0.5}  # the data survived on the PVC
        stale = remote(tag)
        assert all(old_ip in r["error"] and "call .to() again" in r["error"] for r in stale), stale
        remote = kt.fn(_in_rank, name=f"st-{tag}").to(
            kt.Compute(cpus=0.1, launch_timeout=120, store_access={tag: "write"}).distribute(
                "spmd", workers=2
            )
        )
        assert [r.get("error") for r in remote(tag)] == [None, None]
    finally:
        remote.teardown()
        api_after = kt.ls(tag)  # a deployment's teardown leaves the store
        assert api_after
        kt.rm(tag, recursive=True)
    # the CLI: status names the store's current address; teardown keeps the data's claim
    status = _cli("store", "status")
    new_ip = api.get("Pod", ks.POD)["status"]["podIP"]  # type: ignore[index]
    assert status.returncode == 0 and f"http://{new_ip}:{km.SERVER_PORT}" in status.stdout, (
        status.stderr
    )
    assert _cli("put", "cli/k", "--value", "v").returncode == 0
    assert json.loads(_cli("get", "cli/k").stdout) == "v"
    down = _cli("store", "teardown")
    assert "torn down (its PersistentVolumeClaim and data are kept" in down.stdout
    assert (
        api.get("StatefulSet", ks.NAME) is None
        and api.get("PersistentVolumeClaim", ks.CLAIM) is not None
    )
    assert "none" in _cli("store", "status").stdout
    with pytest.raises(DataStoreError, match="no data store in namespace 'default' yet"):
        kt.get("cli/k")
    # made again over the kept claim: the same key, so the objects it holds still verify
    assert _cli("store", "create").returncode == 0
    assert json.loads(_cli("get", "cli/k").stdout) == "v"
    for client in closing:
        client.close()


@pytest.mark.timeout(180)
def test_a_store_whose_install_fails_leaves_nothing_and_the_next_attempt_works(
    harness: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real cluster's case: the default image has no ktlite and cannot install it, so the
    store pod crash-loops; the failed attempt is rolled back, the next one makes a new store."""
    from ktlite.backends.kube_api import KubeApi, load

    monkeypatch.setenv("KTLITE_INSTALL", "ktlite-does-not-exist==0.1")
    failed = _cli("put", "k", "--value", "v")
    assert failed.returncode == 1 and "the pod's setup failed" in failed.stderr, failed.stderr
    assert "could not install ktlite-does-not-exist==0.1" in failed.stderr
    assert (
        "removed what this attempt created (Secret ktlite-store-token, PersistentVolumeClaim ktlite-store, "
        "StatefulSet ktlite-store)" in failed.stderr
    )
    http, info = load(str(harness / "kubeconfig"))
    with http:
        api = KubeApi(http, info.namespace)
        assert api.get("StatefulSet", ks.NAME) is None and api.get("Secret", ks.SECRET) is None
        monkeypatch.delenv("KTLITE_INSTALL")
        kt.put("k", {"v": 1})  # a new store, not the crash-looping one
        assert kt.get("k") == {"v": 1}
        assert api.get("StatefulSet", ks.NAME) is not None
        assert _cli("store", "teardown", "--volumes", "-y").returncode == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
