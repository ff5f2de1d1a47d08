"""ktlite's kubernetes backend against a real cluster (opt-in).

Run: ``KTLITE_TEST_KUBECONFIG=~/.kube/config pytest -m kubernetes tests/kubernetes -v``;
the settings are listed in ``conftest.py``, the cluster setup in ``docs/kubernetes.md``.
Every deployment gets a unique name and is torn down by a fixture, also when a test fails;
what the tests check about the cluster they read through the official client.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import cluster_funcs
import httpx
import pytest

import ktlite as kt

NAME_LABEL = "ktlite.dev/name"
MANAGED_BY_KEY = "app.kubernetes.io/managed-by"
MISSING_IMAGE = "ktlite-does-not-exist:never"

# a kubeconfig with insecure-skip-tls-verify makes the official client warn on every request
pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")


# ---- helpers ---------------------------------------------------------------------------------


def context(err: BaseException) -> str:
    """An error's message and notes: where ktlite names ranks, pods and reasons."""
    return "\n".join([str(err), *getattr(err, "__notes__", [])])


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def wait_for(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float) -> Any:
    """Call ``read`` until ``done(value)`` or ``timeout`` seconds passed; the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(1.0)


def pod_identity(kube: Any, name: str) -> list[tuple[Any, ...]]:
    """Per pod: name, uid, and each container's restart count and start time."""
    out = []
    for pod in kube.pods(name):
        containers = sorted(pod.status.container_statuses or [], key=lambda c: c.name)
        out.append(
            (
                pod.metadata.name,
                pod.metadata.uid,
                tuple(
                    (
                        c.name,
                        c.restart_count,
                        c.state.running.started_at if c.state and c.state.running else None,
                    )
                    for c in containers
                ),
            )
        )
    return out


def servers(status: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return sorted((pod["pod"], pod["server_pid"]) for pod in status)


def rank_pids(status: list[dict[str, Any]]) -> dict[int, int]:
    return {r["rank"]: r["pid"] for pod in status for r in pod["ranks"]}


# ---- one pod ---------------------------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(600)  # the first deploy of a session may pull the image
def test_single_call_returns_value_from_pod_0(deployments, make_compute, kube):
    name = deployments.name("single")
    remote = deployments.to(cluster_funcs.whoami, make_compute(), name)
    out = remote(21, caller_file=__file__)
    assert out["value"] == 42
    assert not out["sees_caller_file"], (
        "the caller's files must not exist on the pods (as on a real cluster)"
    )
    assert out["hostname"] == f"{name}-0", "the function did not run in the StatefulSet's pod 0"
    assert out["env"]["KTLITE_POD_NAME"] == f"{name}-0"
    assert (out["env"]["RANK"], out["env"]["WORLD_SIZE"]) == ("0", "1")
    assert out["python"] == list(sys.version_info[:2])
    assert remote(1)["pid"] == out["pid"], "the rank process lives across calls"

    assert [p["pod"] for p in remote.status()] == [f"{name}-0"]
    # health and resources, read by the pod's server: the process that ran the call, its memory
    rank = remote.status()[0]["ranks"][0]
    assert rank["pid"] == out["pid"] and rank["rss_bytes"] > 0 and rank["cpu_percent"] >= 0, rank
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite.commands.cli",
            "status",
            name,
            "--backend",
            "kubernetes",
            "-n",
            kube.namespace,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [r["pid"] for p in json.loads(done.stdout) for r in p["ranks"]] == [out["pid"]]
    pods = kube.pods(name)
    assert [p.metadata.name for p in pods] == [f"{name}-0"]
    assert pods[0].status.phase == "Running"
    labels = pods[0].metadata.labels or {}
    assert labels.get(NAME_LABEL) == name


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_an_image_with_only_python_gets_ktlite_and_its_packages_from_the_client(
    deployments, make_compute, settings, kube
):
    """An image with a Python and nothing else installed: no pod asks a package index, the
    client ships ktlite's source in the token Secret and, since its Python fits the image's
    (a Linux client, the same ABI), the server's packages in the shared ktlite-deps Secrets."""
    if not settings.bare_image:
        pytest.skip("KTLITE_TEST_BARE_IMAGE is empty")
    if not sys.platform.startswith("linux"):
        pytest.skip("only a Linux client ships the server's packages")
    name = deployments.name("bare")
    where = deployments.to(
        cluster_funcs.where_packages_come_from, make_compute(image=settings.bare_image), name
    )()
    assert where["ktlite_server"].startswith("/ktlite/src/"), where
    assert where["ktlite_wire"].startswith("/ktlite/src/"), where
    for package in ("fastapi", "uvicorn", "cloudpickle"):
        assert where[package].startswith("/ktlite/deps/"), where
    parts = kube.list("secrets", "ktlite.dev/deps")
    assert parts and all(p.metadata.name.startswith("ktlite-deps-") for p in parts)
    assert all(sum(len(base64.b64decode(v)) for v in p.data.values()) <= 1 << 20 for p in parts)


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_pods_run_as_non_root_and_user_code_cannot_read_the_token_from_any_environment(
    deployments, make_compute, kube
):
    """ktlite's pod defaults seen from inside: user 1000, no capabilities, no privilege
    escalation, no service-account token, the deployment token only as a 0440 file (the
    kubelet adds group read for fsGroup), never in the rank's, the server's or the
    container's first process's environment; a writable home, working directory and /tmp."""
    name = deployments.name("nonroot")
    seen = deployments.to(cluster_funcs.what_user_code_sees, make_compute(), name)()
    assert (seen["uid"], seen["gid"]) == (1000, 1000), seen
    assert 1000 in seen["groups"], seen
    for where in ("env_names", "pid1_env_names", "server_env_names"):
        assert "KTLITE_TOKEN" not in seen[where], (where, seen[where])
    assert seen["token_file_env"] is None  # the server keeps even the path to itself
    assert seen["token_file_mode"] == 0o440, oct(seen["token_file_mode"] or 0)
    assert not seen["service_account_token"], "the service-account token is mounted"
    assert seen["cap_eff"] == "0000000000000000", seen["cap_eff"]
    assert seen["no_new_privs"] == "1", seen
    assert seen["home"] == "/home/ktlite" and all(seen["writable"].values()), seen
    pod = kube.pod(f"{name}-0")
    assert pod.spec.security_context.run_as_non_root is True
    assert not [e.name for e in pod.spec.containers[0].env or [] if e.name == "KTLITE_TOKEN"]


# ---- two pods, torch.distributed ---------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(600)  # may pull the torch image
def test_gloo_all_reduce_across_two_pods(settings, deployments, make_compute, kube):
    if not settings.torch_image:
        pytest.skip("KTLITE_TEST_TORCH_IMAGE is empty")
    name = deployments.name("gloo")
    compute = make_compute(settings.torch_image, workers=2, memory="2Gi", launch_timeout=480)
    remote = deployments.to(cluster_funcs.gloo_all_reduce, compute, name)
    results = remote()

    assert isinstance(results, list) and len(results) == 2
    pods = kube.pods(name)
    assert [p.metadata.name for p in pods] == [f"{name}-0", f"{name}-1"]
    ips = [p.status.pod_ip for p in pods]
    for r, res in enumerate(results):
        env = res["env"]
        assert res["rank"] == r and env["RANK"] == str(r), (
            f"results[{r}] came from rank {res['rank']}"
        )
        assert res["world"] == 2
        assert res["sum"] == 3.0, f"rank {r} saw all_reduce = {res['sum']}"
        assert res["hostname"] == f"{name}-{r}"
        assert is_ip(env["MASTER_ADDR"]), f"MASTER_ADDR={env['MASTER_ADDR']!r} is not an IP address"
        assert env["MASTER_ADDR"] == ips[0], "MASTER_ADDR must be pod 0's IP"
        assert env["POD_IPS"].split(",") == ips, "POD_IPS must list the pod IPs in ordinal order"
    assert len({res["env"]["MASTER_PORT"] for res in results}) == 1


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_uneven_pods_1_and_2_ranks_all_reduce(settings, deployments, make_compute, kube):
    """distribute(num_proc=[1, 2]): pod 0 runs rank 0, pod 1 ranks 1 and 2; one gloo group."""
    if not settings.torch_image:
        pytest.skip("KTLITE_TEST_TORCH_IMAGE is empty")
    name = deployments.name("uneven")
    compute = make_compute(settings.torch_image, memory="2Gi", launch_timeout=480).distribute(
        "pytorch", num_proc=[1, 2]
    )
    remote = deployments.to(cluster_funcs.gloo_all_reduce, compute, name)
    results = remote()
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 for r in results), results
    assert [r["hostname"] for r in results] == [f"{name}-0", f"{name}-1", f"{name}-1"]
    assert [(r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for r in results] == [
        ("0", "1"),
        ("0", "2"),
        ("1", "2"),
    ]
    assert [p.metadata.name for p in kube.pods(name)] == [f"{name}-0", f"{name}-1"]


# ---- errors and logs on two pods (one deployment) --------------------------------------------


@pytest.fixture(scope="module")
def pair(module_deployments, make_compute):
    """``cluster_funcs.job`` on 2 pods x 1 rank: rank r runs on pod ``<name>-r``."""
    name = module_deployments.name("pair")
    return module_deployments.to(cluster_funcs.job, make_compute(workers=2), name)


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_rank_error_keeps_its_type_and_the_finished_results(pair):
    name = pair.name
    with pytest.raises(ValueError, match="boom from rank 1") as info:
        pair("fail1", 3)  # rank 0 returns at once, rank 1 raises 3 s later
    err = info.value
    assert isinstance(err, kt.RemoteError)
    text = context(err)
    assert "rank 1" in text and f"{name}-1" in text, text
    errors = [f for f in err.failures if f.kind == "error"]
    assert [(f.rank, f.pod) for f in errors] == [(1, f"{name}-1")]
    assert "raise ValueError" in errors[0].traceback
    assert err.results == {0: {"rank": 0, "hostname": f"{name}-0"}}
    assert pair("rank") == [0, 1], "the deployment must stay usable after a rank error"


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_logs_hold_each_ranks_lines_and_calls_stream_them(pair, capfd):
    name = pair.name
    quiet = f"kt-quiet-{secrets.token_hex(4)}"
    assert pair.options(stream_logs=False)("print", quiet) == [0, 1]
    wanted = [f"[rank {r}] {quiet} {stream} rank={r}" for r in (0, 1) for stream in ("out", "err")]
    text = wait_for(pair.logs, lambda t: all(w in t for w in wanted), timeout=60)
    missing = [w for w in wanted if w not in text]
    assert not missing, f"not in remote.logs(): {missing}\n--- logs ---\n{text[-4000:]}"

    one = wait_for(
        lambda: pair.logs(rank=1), lambda t: f"[rank 1] {quiet} out rank=1" in t, timeout=60
    )
    assert f"[rank 1] {quiet} out rank=1" in one
    assert f"{quiet} out rank=0" not in one, "logs(rank=1) must not hold rank 0's lines"

    # a streamed call: every line reaches the caller, through the API server, with rank and pod
    capfd.readouterr()
    loud = f"kt-loud-{secrets.token_hex(4)}"
    assert pair("print", loud) == [0, 1]
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"[rank {r} @ {name}-{r}] {loud} out rank={r}" in out.splitlines(), out
        assert f"[rank {r} @ {name}-{r}] {loud} err rank={r}" in err.splitlines(), err
    # ... and stays in the pod's log as well
    wanted = [f"[rank {r}] {loud} out rank={r}" for r in (0, 1)]
    text = wait_for(pair.logs, lambda t: all(w in t for w in wanted), timeout=60)
    assert all(w in text for w in wanted), (
        f"streamed lines missing from remote.logs():\n{text[-4000:]}"
    )


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_the_dashboard_shows_a_cluster_deployment(pair):
    """``ktlite dashboard`` over the API server: the deployment in the backend's list, its ranks
    (pod 0 gathers the table, through the pod proxy), its calls' timeline with a failed rank's
    traceback, its pods' logs followed by rank; never its token."""
    import httpx

    from ktlite.dashboard.access import HEADER
    from ktlite.dashboard.serve import Dashboard

    marker = f"kt-dash-{secrets.token_hex(4)}"
    assert pair("print", marker) == [0, 1]
    with pytest.raises(ValueError, match="boom from rank 1"):
        pair("fail1", 0)
    token = pair.deployment.applied.token
    with Dashboard(backends=["kubernetes"], namespace=pair.deployment.backend.namespace) as board:

        def get(path: str) -> Any:
            resp = httpx.get(board.base_url + path, headers={HEADER: board.token}, timeout=60)
            assert resp.status_code == 200, resp.text
            assert token not in resp.text
            return resp.json()

        (listed,) = get("/api/deployments")["backends"]
        assert pair.name in [d["name"] for d in listed["deployments"]], listed
        detail = get(f"/api/deployments/kubernetes/{pair.name}")
        assert sorted(r["rank"] for p in detail["pods"] for r in p["ranks"]) == [0, 1]
        failed, ok = detail["calls"][:2]  # newest first
        assert ok["status"] == "ok" and {r["pod"] for r in ok["ranks"]} == {
            f"{pair.name}-0",
            f"{pair.name}-1",
        }
        assert failed["failed_ranks"] == [1]
        assert "raise ValueError" in failed["ranks"][1]["error"]["traceback"]
        path = f"/api/deployments/kubernetes/{pair.name}/logs"
        lines = wait_for(
            lambda: get(path)["lines"],
            lambda lines: {0, 1} <= {x["rank"] for x in lines if marker in x["text"]},
            timeout=60,
        )
        by_rank = {(x["pod"], x["rank"]) for x in lines if x["text"] == f"{marker} out rank=1"}
        assert by_rank == {(f"{pair.name}-1", 1)}, lines[-20:]


# ---- redeploy --------------------------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_redeploy_after_a_code_change_keeps_the_pods(deployments, make_compute, kube):
    name = deployments.name("redeploy")
    compute = make_compute(workers=2, env={"FOO": "one"})
    r1 = deployments.to(cluster_funcs.version_one, compute, name)
    first = r1()
    assert [v["version"] for v in first] == [1, 1]
    status = r1.status()
    before = pod_identity(kube, name)
    assert [p[0] for p in before] == [f"{name}-0", f"{name}-1"]

    r2 = deployments.to(cluster_funcs.version_two, compute, name)
    r1.deployment.close()  # the replaced handle; the pods live on
    second = r2()
    assert [v["version"] for v in second] == [2, 2], "the pods still run the old code"
    assert [v["foo"] for v in second] == ["one", "one"]
    assert [v["hostname"] for v in second] == [f"{name}-0", f"{name}-1"]
    after = r2.status()
    assert servers(after) == servers(status), (
        "a code-only redeploy must not restart the pod servers"
    )
    assert rank_pids(after) == rank_pids(status), (
        "the code is reloaded into the same rank processes"
    )
    assert [v["pid"] for v in second] == [v["pid"] for v in first]
    assert pod_identity(kube, name) == before, (
        "a code-only redeploy must not replace or restart pods"
    )


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_redeploy_with_a_changed_pod_field_replaces_the_pod(deployments, make_compute, kube):
    name = deployments.name("respec")
    r1 = deployments.to(cluster_funcs.version_one, make_compute(env={"FOO": "one"}), name)
    assert r1()["foo"] == "one"
    uid = kube.pod(f"{name}-0").metadata.uid

    r2 = deployments.to(cluster_funcs.version_one, make_compute(env={"FOO": "two"}), name)
    r1.deployment.close()
    out = r2()
    assert out["foo"] == "two"
    assert out["hostname"] == f"{name}-0"
    assert kube.pod(f"{name}-0").metadata.uid != uid, "a changed env must give a new pod"


# ---- teardown --------------------------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_teardown_leaves_nothing(deployments, make_compute, kube):
    name = deployments.name("teardown")
    remote = deployments.to(cluster_funcs.job, make_compute(workers=2), name)
    assert remote("rank") == [0, 1]
    selector = f"{NAME_LABEL}={name}"

    # what docs/kubernetes.md describes, labelled so that `ktlite.dev/name` finds it all
    statefulsets = kube.list("statefulsets", selector)
    assert [s.metadata.name for s in statefulsets] == [name]
    sts = statefulsets[0]
    assert sts.spec.replicas == 2
    assert sts.spec.pod_management_policy == "Parallel"
    assert sts.spec.update_strategy.type == "OnDelete"
    headless = [s for s in kube.list("services", selector) if s.spec.cluster_ip == "None"]
    assert len(headless) == 1, "one headless Service"
    assert headless[0].spec.publish_not_ready_addresses is True
    assert kube.list("secrets", selector), "the Secret holding the call token"
    assert [p.metadata.name for p in kube.pods(name)] == [f"{name}-0", f"{name}-1"]
    for kind in ("statefulsets", "services", "secrets", "pods"):
        for obj in kube.list(kind, selector):
            labels = obj.metadata.labels or {}
            assert labels.get(MANAGED_BY_KEY) == "ktlite", (
                f"{kind}/{obj.metadata.name} lacks {MANAGED_BY_KEY}=ktlite"
            )

    remote.teardown()
    left = kube.wait_gone(selector, ("statefulsets", "services", "secrets", "pods"), timeout=120)
    assert left == {}, f"still there 120 s after teardown(): {left}"
    with pytest.raises(kt.NotDeployedError):
        remote()
    remote.teardown()  # a second teardown is harmless


# ---- failures before the pods start ------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(300)
def test_missing_image_fails_fast_with_the_pull_error(deployments, make_compute):
    name = deployments.name("noimage")
    compute = make_compute(MISSING_IMAGE, image_pull_policy="IfNotPresent", launch_timeout=300)
    start = time.monotonic()
    with pytest.raises(kt.DeployError) as info:
        deployments.to(cluster_funcs.whoami, compute, name)
    elapsed = time.monotonic() - start
    text = context(info.value)
    assert elapsed < 150, f".to() took {elapsed:.0f}s to report a pull failure (launch_timeout=300)"
    assert "ImagePullBackOff" in text or "ErrImagePull" in text, text
    assert MISSING_IMAGE in text, text


@pytest.mark.kubernetes
@pytest.mark.timeout(300)
def test_unschedulable_request_fails_fast(deployments, make_compute):
    name = deployments.name("toobig")
    compute = make_compute(cpus=10000, launch_timeout=300)
    start = time.monotonic()
    with pytest.raises(kt.DeployError) as info:
        deployments.to(cluster_funcs.whoami, compute, name)
    elapsed = time.monotonic() - start
    text = context(info.value)
    assert elapsed < 120, (
        f".to() took {elapsed:.0f}s to report an unschedulable pod (launch_timeout=300)"
    )
    assert "Unschedulable" in text or "Insufficient cpu" in text, text


# ---- volumes ---------------------------------------------------------------------------------


@pytest.mark.kubernetes
@pytest.mark.kubernetes_volumes
@pytest.mark.timeout(600)
def test_volume_outlives_the_pod_and_teardown_volumes_deletes_it(
    settings, deployments, make_compute, kube, storage_class
):
    name = deployments.name("vol")
    selector = f"{NAME_LABEL}={name}"
    volume = kt.Volume(
        f"{name}-data",
        size="1Gi",
        mount_path="/data",
        access_mode="ReadWriteOnce",
        storage_class=storage_class,
    )
    user = {} if settings.volume_user is None else {"run_as_user": settings.volume_user}
    compute = make_compute(volumes=[volume], **user)
    token = secrets.token_hex(8)

    remote = deployments.to(cluster_funcs.volume_io, compute, name)
    assert remote("write", "/data/probe.txt", token)["mounted"], "/data is not a mounted volume"
    assert remote("read", "/data/probe.txt")["data"] == token
    pvcs = kube.list("persistentvolumeclaims", selector)
    assert pvcs, f"no PersistentVolumeClaim labelled {selector}"
    assert all(p.status.phase == "Bound" for p in pvcs)
    pvc_uids = sorted(p.metadata.uid for p in pvcs)
    pod_uid = kube.pod(f"{name}-0").metadata.uid

    # teardown() keeps the volume ...
    remote.teardown()
    left = kube.wait_gone(selector, ("statefulsets", "services", "secrets", "pods"), timeout=120)
    assert left == {}, f"still there 120 s after teardown(): {left}"
    kept = kube.list("persistentvolumeclaims", selector)
    assert sorted(p.metadata.uid for p in kept) == pvc_uids, (
        "teardown() without volumes=True deleted a PVC"
    )
    assert all(p.metadata.deletion_timestamp is None for p in kept)

    # ... so a new pod of the same name finds the file
    again = deployments.to(cluster_funcs.volume_io, compute, name)
    assert kube.pod(f"{name}-0").metadata.uid != pod_uid
    assert again("read", "/data/probe.txt")["data"] == token

    again.teardown(volumes=True)
    left = kube.wait_gone(selector, timeout=180)
    assert left == {}, f"still there 180 s after teardown(volumes=True): {left}"


# ---- kt.app: a command on replicas, in the caller's working directory -------------------------


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_app_runs_a_command_in_the_shipped_working_directory(
    deployments, make_compute, kube, tmp_path, capfd
):
    # the files travel as an archive that each replica unpacks (on any Python the image has;
    # Debian's 3.11.2 has no tarfile extraction filter)
    name = deployments.name("app")
    token = secrets.token_hex(8)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "message.txt").write_text(f"kt-app-file {token}\n")
    app = kt.app(
        ["cat", "conf/message.txt"], replicas=2, name=name, workdir=tmp_path, compute=make_compute()
    )
    try:
        capfd.readouterr()
        assert app.run() == [0, 0]
        out = capfd.readouterr().out.splitlines()
        for r in (0, 1):
            assert f"[replica {r}] kt-app-file {token}" in out, out
        assert [p.metadata.name for p in kube.pods(name)] == [f"{name}-0", f"{name}-1"]
    finally:
        app.teardown()
    left = kube.wait_gone(
        f"{NAME_LABEL}={name}", ("statefulsets", "services", "secrets", "pods"), timeout=120
    )
    assert left == {}, f"still there 120 s after app.teardown(): {left}"


SERVED_APP = """
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = ("ok" if self.path == "/health" else os.environ["KTLITE_POD_NAME"]).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_a_served_app_is_reached_through_the_api_servers_pod_proxy(
    deployments, make_compute, tmp_path
):
    # kt.app(port=...): the command serves inside each pod, where nothing outside the
    # deployment may connect (its NetworkPolicy); the caller reaches it through the API
    # server's pod proxy and the pod server's /ports/ route, at a local URL
    # (one replica: the stand-in cluster's pods share one loopback interface, so two would
    # contend for the port; on a cluster each pod has its own)
    name = deployments.name("served")
    port = 18000 + secrets.randbelow(2000)
    (tmp_path / "serve.py").write_text(SERVED_APP)
    app = kt.app(
        ["python", "serve.py", str(port)],
        name=name,
        workdir=tmp_path,
        port=port,
        health_check="/health",
        compute=make_compute(),
    )
    try:
        (started,) = app.start()
        assert started["pod"] == f"{name}-0"
        assert httpx.get(app.url + "/", timeout=60).text == f"{name}-0"
        body = os.urandom(2 << 20)
        assert httpx.post(app.url + "/echo", content=body, timeout=120).content == body
    finally:
        app.teardown()
