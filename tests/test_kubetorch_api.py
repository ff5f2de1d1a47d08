"""Issue 13: Kubetorch's public API (``KUBETORCH_API.md``), name by name.

Each public name and argument Kubetorch documents is either accepted with Kubetorch's meaning
or refused with a ``ConfigError`` / ``NotImplementedError`` that names it and says what to
use instead, before anything is deployed: never an ``AttributeError``, a raw ``TypeError`` or
a silent no-op. The tables below are the list, kept in this repository; when the design
documents are next to it (``../shared/KUBETORCH_API.md``), a test checks that every name the
document's tables list is in them.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

import ktlite as kt
from ktlite.backends.base import Plan

API_DOC = Path(__file__).resolve().parent.parent.parent / "shared" / "KUBETORCH_API.md"
REFUSED = "refused"


def work(x: int = 1) -> int:
    return x


class Worker:
    def ping(self) -> str:
        return "pong"


# §1: top-level names. "refused": calling it raises NotImplementedError naming the alternative.
TOP_LEVEL = {
    "fn": "same",
    "Fn": "same",
    "cls": "same",
    "Cls": "same",
    "app": "same",
    "App": "same",
    "Compute": "same",
    "Endpoint": REFUSED,
    "Image": "same",
    "images": "same",
    "Volume": "same",
    "Secret": "same",
    "secret": "same",
    "compute": "same",
    "distribute": "same",
    "autoscale": "same",
    "async_": "same",
    "distributed": "same",
    "put": "same",
    "get": "same",
    "ls": "same",
    "rm": "same",
    "BroadcastWindow": REFUSED,
    "config": "same",
    "LoggingConfig": "same",
    "DebugConfig": REFUSED,
    "MetricsConfig": REFUSED,
    "deep_breakpoint": REFUSED,
}

# §1.2: every Compute parameter, with a value a Kubetorch user would pass
COMPUTE_PARAMS: dict[str, Any] = {
    "cpus": "0.5",
    "memory": "1Gi",
    "disk_size": "10Gi",
    "gpus": "1",
    "gpu_type": "A100",
    "gpu_memory": "16Gi",
    "priority_class_name": "high",
    "namespace": "ml",
    "image": kt.images.Debian(),
    "labels": {"team": "ml"},
    "annotations": {"a": "b"},
    "volumes": ["data"],
    "node_selector": {"pool": "gpu"},
    "service_template": {"spec": {"minReadySeconds": 2}},
    "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
    "env_vars": {"A": "1"},
    "secrets": None,
    "freeze": True,
    "kubeconfig_path": "/tmp/kubeconfig",
    "service_account_name": "trainer",
    "image_pull_policy": "IfNotPresent",
    "inactivity_ttl": "4h",
    "gpu_anti_affinity": False,
    "launch_timeout": 900,
    "working_dir": "/workspace",
    "shared_memory_limit": "1Gi",
    "allowed_serialization": ["json", "pickle"],
    "replicas": 1,
    "logging_config": kt.LoggingConfig(stream_logs=True),
    "queue_name": "team-a",
    "selector": REFUSED,
    "endpoint": REFUSED,
}

# §1.3: distribute()'s parameters (keyword) and its distribution types
DISTRIBUTE_PARAMS: dict[str, Any] = {
    "distribution_type": "pytorch",
    "workers": 2,
    "quorum_timeout": 60,
    "quorum_workers": 2,
    "monitor_members": True,
    "num_proc": "auto",
    "port": 23456,
    "tree_fanout": 50,
    "tree_minimum": 100,
    "max_threads_per_proc": 10,
    "restart_procs": True,
}
DISTRIBUTION_TYPES = ("spmd", "pytorch", "jax", "tensorflow", "tf", "ray", "monarch")

# §1.4: images
IMAGE_PRESETS = (
    "debian",
    "Debian",
    "ubuntu",
    "Ubuntu",
    "python",
    "Python310",
    "Python311",
    "Python312",
    "ray",
    "Ray",
    "pytorch",
    "Pytorch2312",
)
IMAGE_METHODS = {
    "from_docker": "same",
    "from_dockerfile": "same",
    "pip_install": "same",
    "set_env_vars": "same",
    "run_bash": "same",
    "sync_package": REFUSED,
    "copy": REFUSED,
    "rsync": REFUSED,
}

# §1.1: the rest of the feature table
TO_PARAMS = (
    "init_args",
    "stream_logs",
    "get_if_exists",
    "reload_prefixes",
    "prefix_username",
    "dryrun",
)
FN_PARAMS = {
    "name": "same",
    "get_if_exists": "same",
    "reload_prefixes": "same",
    "prefix_username": "same",
    "sync_dir": REFUSED,
    "remote_dir": REFUSED,
    "remote_import_path": REFUSED,
}
VOLUME_PARAMS = (
    "name",
    "size",
    "mount_path",
    "storage_class",
    "access_mode",
    "namespace",
    "volume_name",
)
VOLUME_METHODS = {
    "from_name": "same",
    "create": REFUSED,
    "delete": REFUSED,
    "exists": REFUSED,
    "ssh": REFUSED,
}
SECRET_PARAMS = ("name", "provider", "path", "env_vars", "namespace", "override")
COMPUTE_METHODS = {
    "distribute": "same",
    "autoscale": "same",
    "pip_install": REFUSED,
    "run_bash": REFUSED,
    "sync_package": REFUSED,
    "ssh": REFUSED,
    "pods": REFUSED,
    "is_up": REFUSED,
    "from_manifest": REFUSED,
}
CALL_KWARGS = (
    "async_",
    "stream_logs",
    "stream_metrics",
    "debug",
    "pdb",
    "serialization",
    "workers",
    "restart_procs",
)
LOGGING_FIELDS = (
    "stream_logs",
    "level",
    "include_system_logs",
    "include_events",
    "grace_period",
    "include_name",
    "poll_timeout",
    "grace_poll_timeout",
    "shutdown_grace_period",
)
CONFIG_KEYS = {
    "username": REFUSED,
    "namespace": "same",
    "install_namespace": REFUSED,
    "install_url": REFUSED,
    "stream_logs": REFUSED,
    "stream_metrics": REFUSED,
    "prefix_username": REFUSED,
    "volumes": REFUSED,
    "api_url": REFUSED,
    "cluster_config": REFUSED,
}

# §1.7
EXCEPTIONS = (
    "ControllerRequestError",
    "ImagePullError",
    "KubernetesCredentialsError",
    "PodContainerError",
    "ResourceNotAvailableError",
    "ServiceHealthError",
    "ServiceTimeoutError",
    "StartupError",
    "PodTerminatedError",
    "NotebookError",
    "KnativeServiceConflictError",
    "RsyncError",
    "DataStoreError",
    "VersionMismatchError",
    "SecretNotFound",
    "WorkerMembershipChanged",
)

# §1.5 (the hidden server/dashboard/workload commands are Kubetorch's internals)
CLI_COMMANDS = (
    "check",
    "config",
    "debug",
    "deploy",
    "call",
    "describe",
    "list",
    "port-forward",
    "run",
    "apply",
    "secrets",
    "ssh",
    "teardown",
    "volumes",
    "notebook",
    "logs",
    "put",
    "get",
    "ls",
    "rm",
)


def _refused_clearly(thunk: Any, name: str) -> None:
    with pytest.raises((NotImplementedError, kt.ConfigError)) as info:
        thunk()
    text = str(info.value)
    assert name.strip("_").split(".")[-1].split("(")[0] in text, (
        f"{name}: the error does not name it: {text}"
    )
    assert any(
        w in text for w in ("use", "instead", "give", "pass", "put", "run", "shows", "ktlite")
    ), text


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
def test_every_top_level_name_exists(name: str) -> None:
    assert name in kt.__all__, name
    value = getattr(kt, name)
    if TOP_LEVEL[name] == REFUSED:
        _refused_clearly(value, name)


@pytest.mark.parametrize("name", sorted(COMPUTE_PARAMS))
def test_every_compute_parameter(name: str) -> None:
    value = COMPUTE_PARAMS[name]
    if value == REFUSED:
        _refused_clearly(lambda: kt.Compute(**{name: {"app": "x"}}), name)
        return
    compute = kt.Compute(**{name: value})
    assert kt.Compute(**{name: None}) is not None  # None: "not set", for every field
    if name != "kubeconfig_path":  # a plan reads no cluster; everything renders to valid objects
        plan = kt.fn(work).to(kt.Compute(backend="kubernetes", **{name: value}), dryrun=True)
        assert isinstance(plan, Plan)
        for obj in plan.manifests:
            kubernetes_validate.validate(
                obj, kubernetes_validate.utils.latest_version(), strict=True
            )
    assert compute is not None


def test_all_compute_parameters_together_render_valid_objects() -> None:
    given = {k: v for k, v in COMPUTE_PARAMS.items() if v != REFUSED and k != "kubeconfig_path"}
    compute = kt.Compute(backend="kubernetes", **given).distribute(**DISTRIBUTE_PARAMS)
    plan = kt.fn(work).to(compute, dryrun=True)
    for obj in plan.manifests:
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize("name", sorted(DISTRIBUTE_PARAMS))
def test_every_distribute_parameter(name: str) -> None:
    base = {"workers": 2} if name not in ("workers", "quorum_workers") else {"workers": 2}
    compute = kt.Compute().distribute(**{**base, name: DISTRIBUTE_PARAMS[name]})
    assert compute.distributed is not None
    params = inspect.signature(kt.Compute.distribute).parameters
    assert name in params, f"distribute() does not name {name!r} in its signature"


@pytest.mark.parametrize("kind", DISTRIBUTION_TYPES)
def test_every_distribution_type(kind: str) -> None:
    compute = kt.Compute()
    compute.distribute(kind, workers=2)
    assert compute.distributed.framework in (
        "spmd",
        "pytorch",
        "jax",
        "tensorflow",
        "ray",
        "monarch",
    )


def test_images() -> None:
    for preset in IMAGE_PRESETS:
        assert isinstance(getattr(kt.images, preset)(), kt.Image), preset
    image = kt.Image(
        name="x",
        image_id="python:3.11-slim",
        python_path="/usr/bin/python3",
        install_cmd="pip install",
    )
    for method, how in IMAGE_METHODS.items():
        assert hasattr(kt.Image, method), method
        if how == REFUSED:
            _refused_clearly(lambda m=method: getattr(image, m)("pkg"), method)


@pytest.mark.parametrize("name", TO_PARAMS)
def test_every_to_parameter(name: str) -> None:
    for source in (kt.fn(work), kt.cls(Worker)):
        assert name in inspect.signature(source.to).parameters, (source, name)
    plan = kt.cls(Worker).to(
        kt.Compute(backend="kubernetes"),
        init_args=None,
        stream_logs=False,
        get_if_exists=False,
        reload_prefixes=[],
        prefix_username=None,
        dryrun=True,
    )
    assert isinstance(plan, Plan)
    assert hasattr(kt.fn(work), "to_async") and inspect.iscoroutinefunction(kt.fn(work).to_async)


@pytest.mark.parametrize("name", sorted(FN_PARAMS))
def test_every_fn_and_cls_parameter(name: str) -> None:
    for factory in (kt.fn, kt.cls):
        assert name in inspect.signature(factory).parameters, (factory, name)
    if FN_PARAMS[name] == REFUSED:
        _refused_clearly(lambda: kt.fn(work, **{name: "./src"}), name)


def test_volumes_and_secrets() -> None:
    params = inspect.signature(kt.Volume).parameters
    assert all(p in params for p in VOLUME_PARAMS), sorted(params)
    volume = kt.Volume(
        "data",
        size="1Gi",
        mount_path="/data",
        storage_class="fast",
        access_mode="ReadWriteOnce",
        namespace="ml",
        volume_name="pv-1",
    )
    for method, how in VOLUME_METHODS.items():
        if how == REFUSED:
            _refused_clearly(getattr(volume, method), method)
    assert kt.Volume.from_name("data").mount_path == "/data"
    params = inspect.signature(kt.secret).parameters
    assert all(p in params for p in SECRET_PARAMS), sorted(params)


@pytest.mark.parametrize("method", sorted(COMPUTE_METHODS))
def test_every_compute_method(method: str) -> None:
    assert hasattr(kt.Compute, method), method
    if COMPUTE_METHODS[method] == REFUSED:
        _refused_clearly(lambda: getattr(kt.Compute(), method)(), method)


def test_decorators_take_kubetorchs_keywords() -> None:
    for name in ("get_if_exists", "reload_prefixes", "prefix_username", "name"):
        assert name in inspect.signature(kt.compute).parameters, name
    marked = kt.async_(
        kt.distribute(distribution_type="pytorch", workers=2)(kt.compute(cpus="1")(work))
    )
    assert marked.async_ and marked.compute.distributed.workers == 2
    served = kt.autoscale(min_scale=0, max_scale=3, concurrency=2)(kt.compute(cpus="1")(work))
    assert served.compute.autoscaling.max_scale == 3 and served.compute.distributed is None
    with pytest.raises(
        kt.ConfigError, match=r"\.distribute\(\).*\.autoscale\(\)|\.autoscale\(\).*\.distribute\(\)"
    ):
        kt.autoscale(min_scale=1)(kt.distribute("pytorch", workers=2)(lambda: None))


def test_call_keywords_are_all_known() -> None:
    from ktlite.api.remote import _DEBUG_KWARGS, _KT_CALL_KWARGS

    handled = {*_KT_CALL_KWARGS, *_DEBUG_KWARGS, "async_", "serialization", "stream_metrics"}
    assert set(CALL_KWARGS) <= handled, set(CALL_KWARGS) - handled


def test_logging_config_and_config_keys() -> None:
    params = inspect.signature(kt.LoggingConfig).parameters
    assert all(f in params for f in LOGGING_FIELDS), sorted(params)
    for key, how in CONFIG_KEYS.items():
        if how == REFUSED:
            _refused_clearly(lambda k=key: getattr(kt.config, k), key)
        else:
            getattr(kt.config, key)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_every_exception_name(name: str) -> None:
    exc = getattr(kt, name)
    assert isinstance(exc, type) and issubclass(exc, kt.KtliteError), name
    assert name in kt.__all__


@pytest.mark.parametrize("command", CLI_COMMANDS)
def test_every_cli_command_is_there_or_refused(command: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, (command, out.stderr)


def test_pod_ips_signature() -> None:
    params = inspect.signature(kt.distributed.pod_ips).parameters
    assert "quorum_workers" in params and "quorum_timeout" in params


@pytest.mark.skipif(
    not API_DOC.exists(), reason="the design documents are not next to this checkout"
)
def test_the_tables_cover_the_document() -> None:
    text = API_DOC.read_text()
    exports = text[text.index("## 1. Public API surface") : text.index("### 1.1")]
    names = set(re.findall(r"`([A-Za-z_]+)`", exports)) - {"python_client", "kubetorch", "pod_ips"}
    missing = names - set(TOP_LEVEL) - set(EXCEPTIONS)
    assert not missing, f"top-level names of KUBETORCH_API.md not in the table: {sorted(missing)}"
    compute = text[text.index("### 1.2") : text.index("### 1.3")]
    params = {m for m in re.findall(r"^\| `([a-z_]+)` \|", compute, re.M)}
    assert params and not params - set(COMPUTE_PARAMS), sorted(params - set(COMPUTE_PARAMS))
    distribute = text[text.index("### 1.3") : text.index("### 1.4")]
    dparams = set(re.findall(r"^\| `([a-z_]+)`", distribute, re.M)) - {"distribution_type"}
    assert not dparams - set(DISTRIBUTE_PARAMS), sorted(dparams - set(DISTRIBUTE_PARAMS))
    exceptions = text[text.index("### 1.7") :]
    listed = set(re.findall(r"`([A-Z][A-Za-z]+(?:Error|Changed|NotFound))`", exceptions))
    assert not listed - set(EXCEPTIONS), sorted(listed - set(EXCEPTIONS))
    cli = text[text.index("### 1.5") : text.index("### 1.6")]
    commands = set(re.findall(r"^\| `([a-z-]+)`", cli, re.M))
    hidden = {"server", "dashboard", "workload"}
    assert not commands - set(CLI_COMMANDS) - hidden, sorted(commands - set(CLI_COMMANDS))
