"""Kubernetes-only Compute fields on the local backend: volumes and the one warning.

A ``kt.Volume`` is ``$KTLITE_HOME/volumes/<name>``; every pod sees it at its mount_path
through a private mount namespace (``ktlite_server.mountns``) where this machine allows
one, and the host never sees the mount path. Elsewhere (and with KTLITE_LOCAL_MOUNTS=0,
which the fallback tests set) one LocalBackendWarning names the fields that do nothing
and where the volume's data is. Real pods and processes throughout; no mocks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends import kube_only, local_volumes
from ktlite.backends.kube_only import KUBE_ONLY
from ktlite.backends.local import LocalBackend, pid_alive
from ktlite.commands import cli
from ktlite.specs.deployment_spec import DeploymentSpec

SERVER = Path(__file__).resolve().parents[1] / "server"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def volume_dir(name: str) -> Path:
    return Path(os.environ["KTLITE_HOME"]) / "volumes" / name


def server_pids(name: str) -> list[int]:
    state = json.loads(
        (Path(os.environ["KTLITE_HOME"]) / "local" / name / "state.json").read_text()
    )
    return [p["pid"] for p in sorted(state["pods"], key=lambda p: p["ordinal"])]


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def on_pod(op: str, path: str, text: str = "") -> Any:
    """Runs on every rank: rank 0 writes, rank 1 reads (one rank per pod here)."""
    import os

    rank = int(os.environ["RANK"])
    env = {k: v for k, v in os.environ.items() if k.startswith("KTLITE_VOLUME_")}
    if op == "write" and rank == 0:
        with open(os.path.join(path, "note.txt"), "w") as f:
            f.write(text)
    if op == "read" and rank == 1:
        with open(os.path.join(path, "note.txt")) as f:
            return f.read()
    if op == "listdir":
        return sorted(os.listdir(path))
    if op == "touch":  # a new name: private to the pod, or refused, never on the host
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:
            return e.strerror
        with open(path) as f:
            return f.read()
    if op == "look":
        return {"exists": os.path.exists(path), "env": env, "uid": os.getuid()}
    return rank


@pytest.fixture(scope="module")
def mounts() -> None:
    available, why = local_volumes.mounts_available()
    if not available:
        pytest.skip(f"no private mount namespace here: {why} (the fallback tests below still run)")


# ---- with a private mount namespace ------------------------------------------------------------


def test_a_volume_is_shared_by_pods_and_outlives_redeploys_until_teardown_volumes(mounts) -> None:
    name, vol, path = unique("vol"), unique("data"), f"/{unique('ktlite-test')}"
    compute = kt.Compute(cpus=1, volumes=[kt.Volume(vol, mount_path=path)]).distribute(
        "spmd", workers=2
    )
    remote = kt.fn(on_pod, name=name).to(compute)
    try:
        assert remote("write", path, "from pod 0") == [0, 1]
        assert remote("read", path)[1] == "from pod 0"
        looks = remote("look", path)
        env_name = "KTLITE_VOLUME_" + vol.upper().replace("-", "_")
        assert [look["env"] for look in looks] == [{env_name: path}] * 2
        # the data is in ktlite's directory, owned by this user; the host has no mount path
        assert (volume_dir(vol) / "note.txt").read_text() == "from pod 0"
        assert (volume_dir(vol) / "note.txt").stat().st_uid == os.getuid() == looks[0]["uid"]
        assert not os.path.exists(path)
        # the PIDs ktlite records are the pod servers themselves, not a wrapper around them
        servers = server_pids(name)
        assert [pod["server_pid"] for pod in remote.status()] == servers
        ranks = [r["pid"] for pod in remote.status() for r in pod["ranks"]]
    finally:
        remote.teardown()
    assert wait_gone(servers + ranks) == []
    assert (volume_dir(vol) / "note.txt").read_text() == "from pod 0"  # a plain teardown keeps it

    again = kt.fn(on_pod, name=name).to(compute)
    try:
        assert set(server_pids(name)).isdisjoint(servers)
        assert again("read", path)[1] == "from pod 0"
    finally:
        again.teardown(volumes=True)
    assert not volume_dir(vol).exists()
    assert not os.path.exists(path)

    third = kt.fn(on_pod, name=name).to(compute)
    try:
        assert third("listdir", path) == [[], []]  # a new, empty volume
    finally:
        third.teardown(volumes=True)


def test_two_deployments_share_a_volume_and_only_its_creator_deletes_it(mounts) -> None:
    vol = unique("ktlite-test-shared")  # given by name too: it mounts at /<name>
    maker = kt.fn(on_pod, name=unique("maker")).to(
        kt.Compute(cpus=1, volumes=[kt.Volume(vol, mount_path=f"/{vol}")]).distribute(
            "spmd", workers=2
        )
    )
    user = kt.fn(on_pod, name=unique("user")).to(
        kt.Compute(cpus=1, volumes=[vol]).distribute("spmd", workers=2)
    )
    try:
        maker("write", f"/{vol}", "shared")
        assert user("read", f"/{vol}")[1] == "shared"
        user.teardown(volumes=True)  # it named an existing volume: not its to delete
        assert (volume_dir(vol) / "note.txt").read_text() == "shared"
        maker.teardown()
        assert volume_dir(vol).is_dir()
        maker.teardown(volumes=True)  # after a plain teardown, as on Kubernetes
        assert not volume_dir(vol).exists()
    finally:
        maker.teardown(volumes=True)
        user.teardown()
    assert not os.path.exists(f"/{vol}")


def test_mount_paths_below_or_at_existing_host_directories(mounts, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("host file")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "host-only.txt").write_text("hidden in the pod")
    before = sorted(p.name for p in tmp_path.iterdir())
    deep, over = str(tmp_path / "new" / "dir"), str(tmp_path / "existing")
    compute = kt.Compute(
        cpus=1,
        volumes=[
            kt.Volume(unique("deep"), mount_path=deep),
            kt.Volume(unique("over"), mount_path=over),
        ],
    )
    remote = kt.fn(on_pod, name=unique("paths")).to(compute)
    try:
        assert remote("listdir", str(tmp_path)) == ["existing", "keep.txt", "new"]
        assert remote("listdir", over) == []  # the volume, over the host's directory
        remote("write", deep, "deep")
        remote("write", over, "over")
        assert remote("touch", str(tmp_path / "pod-made.txt"), "pod's own") == "pod's own"
        assert remote("touch", f"/{unique('ktlite-test-top')}", "x") == "Read-only file system"
    finally:
        remote.teardown(volumes=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "existing").iterdir()) == ["host-only.txt"]


def test_a_mount_path_that_is_a_host_file_fails_the_deploy_and_says_why(
    mounts, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("x")
    compute = kt.Compute(
        cpus=1,
        launch_timeout=30,
        volumes=[kt.Volume(unique("onfile"), mount_path=str(tmp_path / "afile"))],
    )
    name = unique("onfile")
    with pytest.raises(kt.DeployError, match="is not a directory"):
        kt.fn(on_pod, name=name).to(compute)
    LocalBackend.shared().teardown(name, timeout=5, volumes=True)
    assert (tmp_path / "afile").read_text() == "x"


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import ktlite as kt

    def hello():
        return os.getpid()

    name, vol = sys.argv[1], sys.argv[2]
    compute = kt.Compute(cpus=1, volumes=[kt.Volume(vol, mount_path="/" + vol)]).distribute("spmd", workers=2)
    remote = kt.fn(hello, name=name).to(compute)
    ranks = remote()
    with open(os.path.join(os.environ["KTLITE_HOME"], "local", name, "state.json")) as f:
        pids = [p["pid"] for p in json.load(f)["pods"]]
    print("PIDS " + json.dumps(pids + ranks), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit: the pods must notice on their own
""")


def test_pods_with_volumes_do_not_outlive_their_creator(mounts) -> None:
    vol = unique("ktlite-test-orphan")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, unique("orphan"), vol],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PIDS ")]
    assert lines, f"child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == -signal.SIGKILL
    pids = json.loads(lines[-1][5:])
    assert len(pids) == 4
    assert wait_gone(pids) == [], "pods outlived the process that created them"
    assert not os.path.exists(f"/{vol}")


def test_mountns_refuses_and_runs_nothing_when_a_step_fails(tmp_path: Path) -> None:
    """The helper itself: a failed step exits 75 with one line, before the command runs."""
    (tmp_path / "root").mkdir()
    (tmp_path / "vol").mkdir()
    (tmp_path / "afile").write_text("x")
    marker = tmp_path / "ran"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SERVER), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite_server.mountns",
            "--root",
            str(tmp_path / "root"),
            "--bind",
            str(tmp_path / "vol"),
            str(tmp_path / "afile"),
            "--",
            "/bin/sh",
            "-c",
            f"touch {marker}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 75, proc.stderr
    assert "could not give this local pod its volumes" in proc.stderr
    assert not marker.exists()
    assert (tmp_path / "afile").read_text() == "x"


# ---- without one (KTLITE_LOCAL_MOUNTS=0): one warning, and where the data is --------------------

ALL_KUBE_ONLY = dict(
    gpu_type="A100",
    cpu_limit=2,
    shared_memory="1Gi",
    node_selector={"pool": "cpu"},
    tolerations=[{"key": "k", "operator": "Exists"}],
    priority_class="high",
    labels={"team": "a"},
    annotations={"note": "x"},
    service_account="trainer",
    image_pull_policy="Always",
    # Kubetorch's fields (namespace and secrets act locally: not here)
    disk_size="1Gi",
    gpu_memory="8Gi",
    gpu_anti_affinity=True,
    working_dir="/w",
    queue_name="q",
    service_template={"spec": {"minReadySeconds": 1}},
    freeze=True,
    run_as_user=0,
    store_access={"datasets": "read"},
)


def test_fallback_warns_once_naming_the_fields_and_where_the_volume_is(monkeypatch) -> None:
    monkeypatch.setenv("KTLITE_LOCAL_MOUNTS", "0")
    name, vol, path = unique("fallback"), unique("data"), f"/{unique('ktlite-test')}"
    compute = kt.Compute(
        cpus=1,
        image=kt.images.pytorch(),
        volumes=[kt.Volume(vol, mount_path=path)],
        **ALL_KUBE_ONLY,
    ).distribute("spmd", workers=2)
    with pytest.warns(kt.LocalBackendWarning) as record:
        remote = kt.fn(on_pod, name=name).to(compute)
    try:
        assert len(record) == 1
        message = str(record[0].message)
        env_name = "KTLITE_VOLUME_" + vol.upper().replace("-", "_")
        for field in (
            *ALL_KUBE_ONLY,
            "image",
            "volumes",
            str(volume_dir(vol)),
            env_name,
            path,
            "KTLITE_LOCAL_MOUNTS=0",
            name,
        ):
            assert field in message, field
        looks = remote("look", path)
        assert [look["exists"] for look in looks] == [False, False]
        assert [look["env"] for look in looks] == [{env_name: str(volume_dir(vol))}] * 2
        remote("write", str(volume_dir(vol)), "via the env var")  # where the data lives instead
        assert remote("read", looks[1]["env"][env_name])[1] == "via the env var"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            remote = kt.fn(on_pod, name=name).to(compute)  # a redeploy: told once already
        assert remote("read", str(volume_dir(vol)))[1] == "via the env var"
    finally:
        remote.teardown()
    assert volume_dir(vol).is_dir()
    assert cli.main(["teardown", name, "--volumes", "--backend", "local"]) == 0
    assert not volume_dir(vol).exists()
    assert not os.path.exists(path)


def test_no_warning_when_nothing_kubernetes_only_is_set(monkeypatch) -> None:
    monkeypatch.setenv("KTLITE_LOCAL_MOUNTS", "0")
    compute = kt.Compute(
        cpus=1,
        memory="1Gi",
        env={"A": "1"},
        max_restarts=1,
        launch_timeout=60,
        image=kt.Image().set_env_vars({"B": "2"}),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remote = kt.fn(on_pod, name=unique("quiet")).to(compute)
    remote.teardown()


# ---- pure: which fields, which mount paths -------------------------------------------------------


def unused_fields(compute: kt.Compute, workers: int) -> list[str]:
    return kube_only.unused_fields(compute.pod_spec(), workers)


@pytest.mark.parametrize("field", sorted(ALL_KUBE_ONLY))
def test_each_kubernetes_only_field_is_named_alone(field: str) -> None:
    assert unused_fields(kt.Compute(**{field: ALL_KUBE_ONLY[field]}), workers=1) == [field]


def test_every_kubernetes_only_field_is_covered() -> None:
    assert set(ALL_KUBE_ONLY) == set(KUBE_ONLY)


def test_image_counts_only_when_it_needs_a_container() -> None:
    assert unused_fields(kt.Compute(image=kt.Image().set_env_vars({"A": "1"})), 1) == []
    assert unused_fields(kt.Compute(image=kt.Image().pip_install("numpy")), 1) == ["image"]
    assert unused_fields(kt.Compute(image="nvcr.io/nvidia/pytorch:24.08-py3"), 1) == ["image"]
    assert unused_fields(kt.Compute(cpus=2, memory="4Gi", gpus=0, env={"A": "1"}), 1) == []


def test_a_ray_worker_pods_options_count_too() -> None:
    compute = kt.Compute(cpus=1).distribute(
        "ray", workers=1, worker_node_options={"node_selector": {"a": "b"}}
    )
    assert unused_fields(compute, compute.distributed.workers) == ["node_selector"]


@pytest.mark.parametrize("path", ["/proc/x", "/sys", "/dev/data"])
def test_mount_paths_under_kernel_trees_are_refused(path: str) -> None:
    with pytest.raises(kt.ConfigError, match="cannot mount into"):
        local_volumes.local_volumes(
            kt.Compute(volumes=[kt.Volume("v", mount_path=path)]).pod_spec()
        )


def test_a_mount_path_hiding_ktlites_home_is_refused() -> None:
    home = os.environ["KTLITE_HOME"]
    for path in (home, str(Path(home).parent)):
        with pytest.raises(kt.ConfigError, match="hide ktlite's own state"):
            local_volumes.local_volumes(
                kt.Compute(volumes=[kt.Volume("v", mount_path=path)]).pod_spec()
            )


def test_the_plan_shows_the_mount_namespace_only_when_it_is_used(monkeypatch) -> None:
    spec = DeploymentSpec(
        "planned", kt.Compute(volumes=[kt.Volume("v", mount_path="/v")]).pod_spec()
    )
    monkeypatch.setenv("KTLITE_LOCAL_MOUNTS", "0")
    assert "ktlite_server.mountns" not in str(LocalBackend.shared().plan(spec))
    monkeypatch.delenv("KTLITE_LOCAL_MOUNTS")
    shown = "ktlite_server.mountns" in str(LocalBackend.shared().plan(spec))
    assert shown == local_volumes.mounts_available()[0]
