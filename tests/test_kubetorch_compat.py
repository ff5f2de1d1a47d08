"""Issue 13: a Kubetorch user's code runs with one import line changed.

Every test here is written the way a Kubetorch user writes it (Kubetorch's names, argument
forms and spellings), one test per failure the issue lists; ktlite's own forms are covered by
the other test files and stay separate. Pure tests first, then tests against real local pods
(one shared deployment per kind).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

import ktlite as kt
from ktlite.backends import kube_manifests as km
from ktlite.backends.kube_diagnose import diagnose
from ktlite.backends.kube_pods import deploy_error
from ktlite.specs.deployment_spec import DeploymentSpec

TAG = uuid.uuid4().hex[:6]
ROOT = Path(__file__).resolve().parent.parent


def rank_info(x: int = 0) -> dict[str, Any]:
    return {"rank": int(os.environ.get("RANK", "0")), "x": x, "pair": (x, x)}


def echo(value: Any) -> Any:
    return value


class Model:
    def __init__(self, scale: int = 2) -> None:
        self.scale = scale

    def predict(self, x: int) -> int:
        return self.scale * x


def _render(compute: kt.Compute) -> list[dict[str, Any]]:
    objs = km.render(
        DeploymentSpec(name="compat", pod=compute.pod_spec()),
        "default",
        image="python:3.11-slim",
        install="ktlite",
        token=None,
    )
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)
    return objs


def _sts(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == "StatefulSet")


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = _sts(objs)["spec"]["template"]["spec"]["containers"][0]
    return container


def _env(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _container(objs)["env"]}


# ---- images ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "image_id"),
    [
        (lambda: kt.images.Debian(), "debian:bookworm-slim"),
        (lambda: kt.images.debian(), "debian:bookworm-slim"),
        (lambda: kt.images.Ubuntu(), "ubuntu:24.04"),
        (lambda: kt.images.ubuntu(), "ubuntu:24.04"),
        (lambda: kt.images.Python310(), "python:3.10-slim"),
        (lambda: kt.images.Python311(), "python:3.11-slim"),
        (lambda: kt.images.Python312(), "python:3.12-slim"),
        (lambda: kt.images.python("3.12"), "python:3.12-slim"),
        (lambda: kt.images.Ray(), "rayproject/ray:2.60.0-py311"),
        (lambda: kt.images.ray(), "rayproject/ray:2.60.0-py311"),
        (lambda: kt.images.Pytorch2312(), "nvcr.io/nvidia/pytorch:23.12-py3"),
    ],
    ids=[
        "Debian",
        "debian",
        "Ubuntu",
        "ubuntu",
        "Python310",
        "Python311",
        "Python312",
        "python",
        "Ray",
        "ray",
        "Pytorch2312",
    ],
)
def test_kubetorch_image_presets(preset: Any, image_id: str) -> None:
    image = preset()
    assert isinstance(image, kt.Image) and image.image_id == image_id
    assert (
        _container(_render(kt.Compute(image=image)))["image"] == "python:3.11-slim"
    )  # render's own
    assert image.pip_install(["numpy"]).run_bash("echo hi").image_id == image_id


def test_kubetorch_image_methods_and_arguments(tmp_path: Path) -> None:
    image = (
        kt.Image(
            image_id="python:3.12-slim",
            name="trainer",
            python_path="/usr/local/bin/python3",
            install_cmd="uv pip install --system",
        )
        .from_docker("python:3.11-slim")
        .pip_install(["numpy"], force=True)
        .run_bash("echo ready", force=True)
        .set_env_vars({"STAGE": "dev"})
    )
    assert image.image_id == "python:3.11-slim" and image.name == "trainer"
    env = _env(_render(kt.Compute(image=image)))
    assert env["KTLITE_PYTHON"] == "/usr/local/bin/python3"
    assert env["KTLITE_PIP_CMD"] == "uv pip install --system"
    # the steps travel in the deployment's token Secret (kube_boot), in this order
    spec = DeploymentSpec(name="compat", pod=kt.Compute(image=image).pod_spec())
    assert km.setup_steps(spec) == [
        ["pip_install", ["--force-reinstall", "numpy"]],
        ["run_bash", "echo ready"],
    ]
    assert env["STAGE"] == "dev"

    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "# base\nFROM python:3.12-slim\nENV A=1 B=two\nRUN pip install numpy && \\\n"
        "    echo done\nENV C 3\n"
    )
    built = kt.Image.from_dockerfile(str(dockerfile))
    assert built.image_id == "python:3.12-slim"
    assert built.env == {"A": "1", "B": "two", "C": "3"}
    assert ("run_bash", "pip install numpy &&  echo done") in built.steps
    dockerfile.write_text("FROM python:3.12-slim\nCOPY . /app\n")
    with pytest.raises(NotImplementedError, match="COPY"):
        kt.Image.from_dockerfile(str(dockerfile))
    for refused in (
        lambda: image.sync_package("mypkg"),
        lambda: image.copy("data/", "/data"),
        lambda: image.rsync("data/"),
    ):
        with pytest.raises(NotImplementedError, match="kt.put|pip_install"):
            refused()
    with pytest.raises(kt.ConfigError, match="python_path"):
        kt.Image(image_id="x", python_path="python3")


# ---- Compute ------------------------------------------------------------------------------------


def test_kubetorch_compute_forms_none_and_string_gpus() -> None:
    compute = kt.Compute(
        cpus="0.5",
        memory="1Gi",
        gpus="1",
        tolerations=None,
        env_vars=None,
        labels=None,
        annotations=None,
        volumes=None,
        node_selector=None,
        secrets=None,
        image=None,
        namespace=None,
        inactivity_ttl=None,
        launch_timeout=None,
        image_pull_policy=None,
        gpu_type=None,
    )
    assert compute.gpus == 1 and compute.tolerations == () and compute.env == {}
    assert compute.launch_timeout == 600.0
    assert kt.Compute(gpus=None).gpus == 0
    with pytest.raises(kt.ConfigError, match="gpus='A100:1'.*gpu_type"):
        kt.Compute(gpus="A100:1")


def test_kubetorch_compute_field_names_render() -> None:
    compute = kt.Compute(
        cpus=1,
        priority_class_name="high",
        service_account_name="trainer",
        shared_memory_limit="2Gi",
        disk_size="20Gi",
        gpu_memory="16Gi",
        working_dir="/workspace",
        queue_name="team-a",
        freeze=True,
        service_template={
            "spec": {"template": {"spec": {"hostIPC": True}}, "minReadySeconds": 3},
            "metadata": {"labels": {"team": "ml"}},
        },
    )
    assert compute.priority_class == "high" and compute.service_account == "trainer"
    assert compute.shared_memory == "2Gi"
    objs = _render(compute)
    sts = _sts(objs)
    pod = sts["spec"]["template"]["spec"]
    container = _container(objs)
    assert pod["priorityClassName"] == "high" and pod["serviceAccountName"] == "trainer"
    assert pod["hostIPC"] is True and sts["spec"]["minReadySeconds"] == 3
    assert (
        sts["metadata"]["labels"]["team"] == "ml"
        and sts["metadata"]["labels"][km.NAME_LABEL] == "compat"
    )
    assert container["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    assert container["workingDir"] == "/workspace"
    assert _env(objs)["KTLITE_WORKDIR"] == "/workspace"  # user code runs there, writable or not
    assert sts["spec"]["template"]["metadata"]["annotations"][km.GPU_MEMORY_ANNOTATION] == "16Gi"
    assert sts["spec"]["template"]["metadata"]["labels"][km.QUEUE_LABEL] == "team-a"
    assert _env(objs)["KTLITE_FREEZE"] == "1"
    # the template is part of the pod hash: changing it replaces the pods
    other = _render(
        kt.Compute(cpus=1, service_template={"spec": {"template": {"spec": {"hostIPC": False}}}})
    )
    hashes = {
        _sts(o)["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION]
        for o in (objs, other)
    }
    assert len(hashes) == 2
    anti = _render(kt.Compute(cpus=1, gpu_anti_affinity=True))
    terms = _sts(anti)["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    assert "nvidia.com/gpu.present" in json.dumps(terms)
    assert (
        "affinity"
        not in _sts(_render(kt.Compute(gpus=1, gpu_anti_affinity=True)))["spec"]["template"]["spec"]
    )


def test_kubetorch_compute_fields_ktlite_refuses_before_deploying() -> None:
    with pytest.raises(NotImplementedError, match="bring your own pods|creates and owns"):
        kt.Compute(selector={"app": "mine"})
    with pytest.raises(NotImplementedError, match="creates and owns"):
        kt.Compute(endpoint="http://x")
    fixed = kt.Compute(replicas=2)  # may still be distributed; alone: 2 load-balanced replicas
    plan = kt.fn(echo).to(fixed, dryrun=True)
    assert "autoscaled: 2..2 replicas" in str(plan) and str(plan).count("--pod echo-") == 2, str(
        plan
    )
    assert kt.Compute(replicas=2).distribute("pytorch", workers=2).distributed.workers == 2
    with pytest.raises(kt.ConfigError, match="replicas=3"):
        kt.Compute(replicas=3, distributed=kt.Compute().distribute(workers=2).distributed)
    with pytest.raises(kt.ConfigError, match="LoggingConfig"):
        kt.LoggingConfig(level="debug")
    assert kt.Compute(logging_config=kt.LoggingConfig(stream_logs=False)).stream_logs is False
    with pytest.raises(kt.ConfigError, match="allowed_serialization"):
        kt.Compute(allowed_serialization=["yaml"])


def test_kubetorch_distribute_changes_the_compute_it_is_called_on() -> None:
    compute = kt.Compute(cpus=1)
    compute.distribute("pytorch", workers=3)  # result not assigned, as Kubetorch's examples do
    assert compute.distributed.workers == 3 and compute.distributed.framework == "pytorch"
    assert compute.distribute(distribution_type="tf", workers=2, num_proc="auto") is compute
    assert compute.distributed.framework == "tensorflow" and compute.distributed.num_proc == 1
    compute.distribute(
        "spmd",
        workers=2,
        quorum_workers=2,
        quorum_timeout=30,
        monitor_members=True,
        max_threads_per_proc=4,
        restart_procs=True,
        tree_fanout=50,
        tree_minimum=100,
    )
    assert (
        compute.concurrency == 4
        and compute.restart_procs
        and compute.distributed.quorum_timeout == 30
    )
    with pytest.raises(kt.ConfigError, match="quorum_workers=1.*all 2"):
        compute.distribute("spmd", workers=2, quorum_workers=1)
    with pytest.raises(kt.ConfigError, match="unknown option"):
        compute.distribute("spmd", workers=2, heterogeneous=True)
    plan = kt.fn(echo).to(
        kt.Compute(backend="kubernetes").distribute("pytorch", workers=3), dryrun=True
    )
    assert _sts(plan.manifests)["spec"]["replicas"] == 3


def test_kubetorch_decorator_names_are_normalised() -> None:
    @kt.compute(name="GNN_Inference", cpus="0.1", get_if_exists=True)
    @kt.distribute("pytorch", workers=2)
    def gnn() -> None:
        return None

    assert gnn.name == "gnn-inference" and gnn.get_if_exists
    assert kt.fn(echo, name="My_Fn").name == "my-fn"
    with pytest.raises(kt.ConfigError, match="prefix"):
        kt.compute(cpus=1, prefix_username=True)
    with pytest.raises(kt.ConfigError, match="reload_prefixes"):
        kt.fn(echo).to(kt.Compute(), reload_prefixes=["main"])
    with pytest.raises(NotImplementedError, match="sync_dir"):
        kt.fn(echo, sync_dir="./src")


# ---- exceptions ---------------------------------------------------------------------------------


def test_kubetorch_exception_names_exist_and_mean_the_same() -> None:
    assert issubclass(kt.WorkerMembershipChanged, kt.RankDied)
    assert issubclass(kt.WorkerMembershipChanged, kt.PodUnreachable)
    err = kt.WorkerMembershipChanged(
        "lost", previous_ips=["10.0.0.1", "10.0.0.2"], current_ips=["10.0.0.1", "10.0.0.9"]
    )
    assert err.removed_ips == ["10.0.0.2"] and err.added_ips == ["10.0.0.9"]
    oom = kt.PodTerminatedError("boom", pod_name="p-0", reason="OOMKilled")
    assert oom.is_oom and oom.pod_name == "p-0" and isinstance(oom, kt.DeployError)
    assert (
        kt.ServiceTimeoutError is kt.LaunchTimeout
        and kt.VersionMismatchError is kt.ProtocolMismatch
    )
    for name in (
        "ImagePullError",
        "ResourceNotAvailableError",
        "StartupError",
        "SecretNotFound",
        "ControllerRequestError",
        "PodContainerError",
        "RsyncError",
        "KnativeServiceConflictError",
    ):
        assert issubclass(getattr(kt, name), kt.DeployError), name
    assert issubclass(kt.KubernetesCredentialsError, kt.ConfigError)


def _pod(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "job-0"}, "status": status}


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (
            {
                "containerStatuses": [
                    {
                        "image": "nope:1",
                        "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}},
                    }
                ]
            },
            kt.ImagePullError,
        ),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/1 nodes: Insufficient nvidia.com/gpu",
                    }
                ]
            },
            kt.ResourceNotAvailableError,
        ),
        (
            {
                "containerStatuses": [
                    {
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "aws" not found',
                            }
                        }
                    }
                ]
            },
            kt.SecretNotFound,
        ),
        (
            {
                "containerStatuses": [
                    {"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
                ]
            },
            kt.PodTerminatedError,
        ),
        (
            {"phase": "Failed", "reason": "Evicted", "message": "low on memory"},
            kt.PodTerminatedError,
        ),
        (
            {
                "containerStatuses": [
                    {
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 1}},
                    }
                ]
            },
            kt.StartupError,
        ),
    ],
    ids=["image-pull", "unschedulable", "secret", "oom", "evicted", "crash"],
)
def test_kubetorch_deploy_errors_by_kind(status: dict[str, Any], error: type[Exception]) -> None:
    problem = diagnose(_pod(status))
    assert problem is not None and problem.fatal
    raised = deploy_error(problem, "why")
    assert type(raised) is error and isinstance(raised, kt.DeployError)
    if isinstance(raised, kt.PodTerminatedError):
        assert raised.pod_name == "job-0" and raised.reason in ("OOMKilled", "Evicted")
        assert raised.is_oom == (raised.reason == "OOMKilled")


# ---- module-level names -------------------------------------------------------------------------


def test_kubetorch_names_ktlite_refuses_say_what_to_use() -> None:
    for thunk, words in [
        (lambda: kt.DebugConfig(mode="pdb"), "remote.logs"),
        (lambda: kt.deep_breakpoint(), "remote.logs"),
        (lambda: kt.MetricsConfig(interval=30), "remote.status()"),
        (lambda: kt.Endpoint(url="http://x"), "kt.Compute"),
        (lambda: kt.BroadcastWindow(), "kt.get"),
    ]:
        with pytest.raises(NotImplementedError, match="not supported by ktlite") as info:
            thunk()
        assert words in str(info.value)


def test_kubetorch_config_object(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path))
    monkeypatch.delenv("KTLITE_NAMESPACE", raising=False)
    assert kt.config.namespace is None
    kt.config.namespace = "team"  # this process (and pods it starts) only
    try:
        assert kt.config.namespace == "team" and os.environ["KTLITE_NAMESPACE"] == "team"
    finally:
        kt.config.namespace = None
    kt.config.set("namespace", "saved")
    assert json.loads((tmp_path / "config.json").read_text())["namespace"] == "saved"
    assert kt.config.get("namespace") == "saved"  # the module's functions pass through
    with pytest.raises(kt.ConfigError, match="no username prefix"):
        kt.config.username = "me"
    with pytest.raises(AttributeError, match="no setting"):
        kt.config.nonsense  # noqa: B018


def test_kubetorch_cli_commands_ktlite_lacks_are_refused_clearly() -> None:
    for command in ("debug", "apply", "ssh", "volumes", "notebook", "secrets"):
        out = subprocess.run(
            [sys.executable, "-m", "ktlite.commands.cli", command, "x"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (command, out.stderr)
        assert "Kubetorch's command" in out.stderr and "ktlite" in out.stderr


# ---- against real local pods --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> Any:
    remote = kt.fn(rank_info, name=f"compat-ranks-{TAG}").to(
        kt.Compute(cpus="0.1").distribute("spmd", workers=2, num_proc=1)
    )
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def model() -> Any:
    remote = kt.cls(Model, name=f"compat-model-{TAG}").to(kt.Compute(cpus="0.1"), {"scale": 3})
    yield remote
    remote.teardown()


def test_kubetorch_workers_forms(ranks: Any) -> None:
    assert [r["rank"] for r in ranks(1, workers="any")] == [0]
    assert [r["rank"] for r in ranks(1, workers="ready")] == [0, 1]
    assert [r["rank"] for r in ranks(1, workers=[1])] == [1]
    assert [r["rank"] for r in ranks(1, workers="127.0.0")] == [0, 1]  # a piece of the pods' IP
    with pytest.raises(kt.ConfigError, match="no pod"):
        ranks(1, workers=["10.1.2.3"])


def test_kubetorch_async_and_serialization_attributes(ranks: Any) -> None:
    ranks.async_ = True
    try:
        future = ranks(5)
        assert isinstance(future, kt.Future)
        assert [r["x"] for r in asyncio.run(_await(future))] == [5, 5]
    finally:
        ranks.async_ = False
    assert isinstance(ranks(5, async_=True), kt.Future)
    assert ranks(2)[0]["pair"] == (2, 2)  # pickle: tuples stay tuples
    ranks.serialization = "json"
    try:
        assert ranks(2)[0]["pair"] == [2, 2]  # what Kubetorch's JSON gives back
        with pytest.raises(kt.SerializationError, match="not JSON"):
            ranks({1, 2})
    finally:
        ranks.serialization = None
    assert ranks(2, serialization="json")[1]["pair"] == [2, 2]
    with pytest.raises(kt.ConfigError, match="'none'"):
        ranks.serialization = "none"
    with pytest.raises(AttributeError, match="settable: async_, serialization, stream_logs"):
        ranks.retries = 3
    with pytest.raises(NotImplementedError, match="remote debugger"):
        ranks(1, debug=True)
    with pytest.raises(NotImplementedError, match="streams no metrics"):
        ranks(1, stream_metrics=True)


async def _await(future: Any) -> Any:
    return await future


def test_kubetorch_reattach_by_name_and_get_if_exists(ranks: Any, model: Any) -> None:
    again = kt.fn(name=ranks.name)
    assert [r["rank"] for r in again(7)] == [0, 1] and again(7)[1]["x"] == 7
    assert [r["rank"] for r in again(1, workers="any")] == [0]
    instance = kt.cls(name=model.name)
    assert instance.predict(4) == 12  # one value: the class was not distributed
    with pytest.raises(kt.ConfigError, match="kt.cls"):
        kt.fn(name=model.name)
    with pytest.raises(kt.NotDeployedError, match="no deployment"):
        kt.fn(name=f"never-deployed-{TAG}")
    launch = ranks.status()[0]["launch_id"]
    same = kt.fn(rank_info).to(
        kt.Compute(cpus="0.1").distribute("spmd", workers=2), name=ranks.name, get_if_exists=True
    )
    assert same.status()[0]["launch_id"] == launch and [r["rank"] for r in same(1)] == [0, 1]
    with pytest.raises(kt.ConfigError, match="get_if_exists"):
        kt.fn(rank_info).to(
            kt.Compute().distribute("spmd", workers=3), name=ranks.name, get_if_exists=True
        )


def test_kubetorch_decorated_class_is_a_service_handle_and_async(model: Any) -> None:
    marked = kt.compute(cpus="0.1", name=model.name, get_if_exists=True)(Model)
    assert marked.predict(5) == 15  # attaches to the running service by its name
    assert isinstance(marked.predict.submit(1), kt.Future)
    with pytest.raises(AttributeError, match="no method 'train'"):
        marked.train  # noqa: B018

    asynced = kt.async_(kt.compute(cpus="0.1", name=model.name)(Model))
    future = asynced.predict(2)
    assert isinstance(future, kt.Future) and future.result(timeout=60) == 6


def test_kubetorch_distribute_on_a_deployed_compute_copy_is_the_deployments_own(ranks: Any) -> None:
    compute = kt.Compute(cpus="0.1")
    remote = kt.fn(echo, name=f"compat-own-{TAG}").to(compute)
    try:
        compute.distribute("spmd", workers=3)  # the caller's object changes, the deployment's not
        assert remote.compute.distributed is None and remote(4) == 4
    finally:
        remote.teardown()


def test_kubetorch_run_app_script(tmp_path: Path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        import ktlite as kt

        kt.app(name="compat-run-{TAG}", cpus="0.1", replicas=2)
        # on each replica: the rest of the script, with the arguments `ktlite run` got
        print(f"replica {{os.environ['NODE_RANK']}} of {{os.environ['WORLD_SIZE']}} args {{sys.argv[1:]}}")
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "server")])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite.commands.cli",
            "run",
            "python",
            "my_script.py",
            "--epochs",
            "3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for replica in (0, 1):
        assert f"replica {replica} of 2 args ['--epochs', '3']" in out.stdout, out.stdout
    assert "exit codes [0, 0]" in out.stderr
    # run as a plain script, kt.app() returns None and the script goes on here
    plain = subprocess.run(
        [sys.executable, "my_script.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "NODE_RANK": "x", "WORLD_SIZE": "y"},
    )
    assert plain.returncode == 0 and "replica x of y args []" in plain.stdout, plain.stderr
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite.commands.cli",
            "run",
            "--replicas",
            "3",
            "python",
            "my_script.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert refused.returncode == 1 and "kt.app(...)" in refused.stderr


def test_kubetorch_app_port_outside_ktlite_run_lets_the_script_go_on() -> None:
    # Kubetorch's form at the top of a script: under plain python (on the pods, or run by
    # hand) kt.app returns None and the script serves; a bad port is told at once all the same
    assert kt.app(name="web", port=8000, health_check="/health") is None
    assert kt.app(name="not-under-run") is None
    with pytest.raises(kt.ConfigError, match="port=0"):
        kt.app(name="web", port=0)
