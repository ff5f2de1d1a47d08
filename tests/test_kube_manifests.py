"""Kubernetes manifests, pure: no cluster is contacted.

Every Compute setting is rendered through the public dry-run path
(``kt.fn(f).to(compute, dryrun=True).manifests``) and through ``kube_manifests.render``
with a real token, then checked against the Kubernetes OpenAPI schemas (strict, the oldest
supported and the newest known version) and for where each setting lands.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
import yaml

import ktlite as kt
from ktlite import config
from ktlite.backends import kube_boot, shipped_source
from ktlite.backends import kube_manifests as km
from ktlite.backends.base import Plan
from ktlite.net import tls
from ktlite.specs.deployment_spec import DeploymentSpec

NAME = "case-x"
TOKEN = "s3cr3t-t0ken-value"
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
DEFAULT_IMAGE = f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def train(epochs: int = 1) -> int:
    return epochs


def evaluate() -> str:
    return "other code, same pods"


@pytest.fixture(autouse=True)
def _clean_settings(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults only: no config file, no KTLITE_* overrides from the environment."""
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "ktlite-home"))
    for key in (
        "KTLITE_IMAGE",
        "KTLITE_INSTALL",
        "KTLITE_NAMESPACE",
        "KTLITE_IMAGE_PULL_POLICY",
        "KTLITE_BACKEND",
        "KTLITE_CONTEXT",
        "KTLITE_KUBECONFIG",
        "KTLITE_LOG_LEVEL",
    ):
        monkeypatch.delenv(key, raising=False)


# ---- helpers -------------------------------------------------------------------------------------


def K(**kwargs: Any) -> kt.Compute:  # reads like kt.Compute(backend="kubernetes", ...)
    return kt.Compute(backend="kubernetes", **kwargs)


def _plan(compute: kt.Compute, fn: Callable[..., Any] = train, name: str = NAME) -> Plan:
    plan = kt.fn(fn).to(compute, name=name, dryrun=True)
    assert isinstance(plan, Plan)
    assert plan.backend == "kubernetes"
    return plan


def _render(
    compute: kt.Compute,
    token: str | None = TOKEN,
    namespace: str = "default",
    image: str = DEFAULT_IMAGE,
) -> list[dict[str, Any]]:
    return km.render(
        DeploymentSpec(name=NAME, pod=compute.pod_spec()),
        namespace,
        image=image,
        install=km.install_spec(),
        token=token,
    )


def _one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, [o["kind"] for o in objs]
    return found[0]


def _sts(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(objs, "StatefulSet")


def _pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _sts(objs)["spec"]["template"]["spec"]
    return spec


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _pod(objs)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    entries = _container(objs)["env"]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e for e in entries}


def _value(objs: list[dict[str, Any]], name: str) -> str:
    value: str = _env(objs)[name]["value"]
    return value


def _pod_hash(objs: list[dict[str, Any]]) -> str:
    value: str = _sts(objs)["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION]
    return value


def _mounts(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in _container(objs)["volumeMounts"]}


def _pod_volumes(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in _pod(objs)["volumes"]}


def _validate(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:  # its str() dumps the whole schema
        where = "/".join(map(str, e.absolute_path)) or "(top)"
        pytest.fail(
            f"{obj['kind']} {obj['metadata']['name']} is not valid Kubernetes {version} "
            f"(strict): {e.message} at {where}",
            pytrace=False,
        )


# ---- the matrix: every setting renders to strictly valid objects ---------------------------------


def EVERYTHING() -> kt.Compute:
    return K(
        cpus="1500m",
        memory="8Gi",
        cpu_limit=4,
        memory_limit="16Gi",
        gpus=8,
        gpu_type="NVIDIA-H100-80GB-HBM3",
        image=kt.Image("nvcr.io/nvidia/pytorch:24.08-py3")
        .pip_install(["numpy", "rich==13.7.1"])
        .run_bash("apt-get update && apt-get install -y jq")
        .set_env_vars({"IMG_VAR": "1"}),
        env={"FOO": "bar"},
        volumes=[
            kt.Volume("data", size="100Gi"),
            kt.Volume(
                "scratch",
                size="50Gi",
                access_mode="ReadWriteOnce",
                storage_class="local-path",
                mount_path="/mnt/scratch",
            ),
            "existing-claim",
        ],
        namespace="ml-team",
        node_selector={"pool": "gpu"},
        tolerations=[GPU_TOLERATION],
        labels={"team": "ml"},
        annotations={"owner": "alice@example.com"},
        secrets=["hf-token", "wandb-creds"],
        service_account="trainer",
        image_pull_policy="IfNotPresent",
        priority_class="high-priority",
        shared_memory="16Gi",
    ).distribute("pytorch", workers=4, num_proc=2, port=23456)


CASES: dict[str, Callable[[], kt.Compute]] = {
    "defaults": lambda: K(),
    "cpus-int": lambda: K(cpus=2),
    "cpus-float": lambda: K(cpus=0.5),
    "cpus-millicores": lambda: K(cpus="500m"),
    "memory": lambda: K(memory="4Gi"),
    "memory-decimal-si": lambda: K(memory="1.5G"),
    "limits": lambda: K(cpus=1, memory="1Gi", cpu_limit=2.5, memory_limit="2Gi"),
    "limits-only": lambda: K(cpu_limit="750m", memory_limit="512Mi"),
    "gpus-1": lambda: K(gpus=1),
    "gpus-8-typed": lambda: K(gpus=8, gpu_type="NVIDIA-A100-SXM4-80GB"),
    "image-string": lambda: K(image="ghcr.io/acme/train:1.2"),
    "image-steps": lambda: K(
        image=kt.Image("python:3.11-slim")
        .pip_install(["numpy"])
        .run_bash("echo hi > /tmp/hi")
        .set_env_vars({"A": "1", "B": "2"})
        .pip_install("tqdm")
    ),
    "image-freeze": lambda: K(image=kt.Image("acme/ready:1", freeze=True)),
    "preset-python": lambda: K(image=kt.images.python("3.12")),
    "preset-pytorch": lambda: K(image=kt.images.pytorch()),
    "preset-ray": lambda: K(image=kt.images.ray()),
    "preset-debian": lambda: K(image=kt.images.debian()),
    "env": lambda: K(env={"FOO": "bar", "EMPTY": ""}),
    "env-vars": lambda: K(env_vars={"HF_HOME": "/data/hf"}),
    "volume-rwx": lambda: K(volumes=[kt.Volume("data", size="20Gi")]),
    "volume-rwo-class": lambda: K(
        volumes=[
            kt.Volume(
                "ckpt",
                size="5Gi",
                mount_path="/ckpt",
                access_mode="ReadWriteOnce",
                storage_class="fast-ssd",
            )
        ]
    ),
    "volume-existing": lambda: K(volumes=["shared-datasets", "models"]),
    "node-selector": lambda: K(node_selector={"pool": "cpu", "kubernetes.io/arch": "amd64"}),
    "tolerations": lambda: K(
        tolerations=[
            GPU_TOLERATION,
            {
                "key": "spot",
                "operator": "Equal",
                "value": "true",
                "effect": "NoExecute",
                "tolerationSeconds": 60,
            },
        ]
    ),
    "labels": lambda: K(labels={"team": "ml", "app.kubernetes.io/part-of": "research"}),
    "annotations": lambda: K(annotations={"owner": "alice@example.com", "note": "a b: c"}),
    "secrets": lambda: K(secrets=["hf-token"]),
    "service-account": lambda: K(service_account="trainer"),
    "pull-always": lambda: K(image_pull_policy="Always"),
    "pull-if-not-present": lambda: K(image_pull_policy="IfNotPresent"),
    "pull-never": lambda: K(image_pull_policy="Never"),
    "priority-class": lambda: K(priority_class="high-priority"),
    "shared-memory": lambda: K(shared_memory="2Gi"),
    "namespace": lambda: K(namespace="ml-team"),
    "distribute-pytorch": lambda: K(cpus=2).distribute(
        "pytorch", workers=4, num_proc=2, port=23456
    ),
    "everything": EVERYTHING,
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_setting_renders_strictly_valid_objects(case: str, version: str) -> None:
    compute = CASES[case]()
    plan = _plan(compute)
    image = compute.image.image_id if compute.image is not None else DEFAULT_IMAGE
    rendered = _render(compute, namespace=compute.namespace or "default", image=image)
    claims = [v for v in compute.volumes if isinstance(v, kt.Volume)]
    for objs in (plan.manifests, rendered):
        assert [o["kind"] for o in objs] == [
            "Secret",
            "Service",
            *["PersistentVolumeClaim"] * len(claims),
            "NetworkPolicy",
            "StatefulSet",
        ]
        for obj in objs:
            _validate(obj, version)
        _env(objs)  # env names are unique
        paths = [m["mountPath"] for m in _container(objs)["volumeMounts"]]
        assert len(paths) == len(set(paths))
    # the plan and a deploy render the same objects but for the token and what it keys (the
    # digest of the setup steps, which may hold an index password)
    assert _keyless(plan.manifests[1:]) == _keyless(rendered[1:])


def _keyless(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``objs`` without the setup steps' digest (keyed by the token) and the hash over it."""
    out = json.loads(json.dumps(objs))
    for obj in out:
        if obj["kind"] == "StatefulSet":
            template = obj["spec"]["template"]
            template["metadata"]["annotations"].pop(km.HASH_ANNOTATION)
            env = template["spec"]["containers"][0]["env"]
            env[:] = [e for e in env if e["name"] != kube_boot.SETUP_DIGEST_ENV]
    return out


def test_matrix_covers_what_it_claims() -> None:
    assert len(CASES) >= 15
    assert VERSIONS[0] != VERSIONS[1]


# ---- resources -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "quantity"),
    [(2, "2"), (0.5, "500m"), ("500m", "500m"), (1.5, "1500m"), ("2", "2"), ("0.25", "250m")],
)
def test_cpus_and_memory_become_requests(cpus: Any, quantity: str) -> None:
    resources = _container(_plan(K(cpus=cpus, memory="4Gi")).manifests)["resources"]
    assert resources == {"requests": {"cpu": quantity, "memory": "4Gi"}}


def test_no_resources_unless_asked() -> None:
    assert "resources" not in _container(_plan(K()).manifests)


def test_limits_only_when_given() -> None:
    assert "limits" not in _container(_plan(K(cpus=1, memory="1Gi")).manifests)["resources"]
    resources = _container(
        _plan(K(cpus=1, memory="1Gi", cpu_limit=2.5, memory_limit="2Gi")).manifests
    )["resources"]
    assert resources == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "2500m", "memory": "2Gi"},
    }
    only = _container(_plan(K(memory_limit="512Mi")).manifests)["resources"]
    assert only == {"limits": {"memory": "512Mi"}}


def test_gpus_are_requested_and_limited() -> None:
    objs = _plan(K(cpus=8, gpus=8, gpu_type="NVIDIA-A100-SXM4-80GB")).manifests
    resources = _container(objs)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "8"
    assert resources["limits"] == {"nvidia.com/gpu": "8"}
    assert _pod(objs)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert _value(objs, "KTLITE_PROCS") == "8"  # one rank process per GPU before code arrives


def test_one_gpu_without_type_selects_no_node() -> None:
    objs = _plan(K(gpus=1)).manifests
    assert _container(objs)["resources"] == {
        "requests": {"nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert "nodeSelector" not in _pod(objs)
    assert _value(objs, "KTLITE_PROCS") == "1"


def test_no_gpu_means_no_gpu_resource() -> None:
    objs = _plan(K(cpus=1)).manifests
    assert "nvidia.com/gpu" not in json.dumps(_container(objs))
    assert _value(objs, "KTLITE_PROCS") == "1"


# ---- scheduling and pod settings -----------------------------------------------------------------


def test_node_selector_merges_with_gpu_type() -> None:
    objs = _plan(K(gpus=1, gpu_type="H100", node_selector={"pool": "gpu"})).manifests
    assert _pod(objs)["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "H100"}


def test_tolerations_land_on_the_pod() -> None:
    spot = {
        "key": "spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoExecute",
        "tolerationSeconds": 60,
    }
    assert _pod(_plan(K(tolerations=[GPU_TOLERATION, spot])).manifests)["tolerations"] == [
        GPU_TOLERATION,
        spot,
    ]
    assert "tolerations" not in _pod(_plan(K()).manifests)


def test_labels_go_on_the_pod_template_and_cannot_steal_the_name_label() -> None:
    objs = _plan(K(labels={"team": "ml", km.NAME_LABEL: "someone-else"})).manifests
    template_labels = _sts(objs)["spec"]["template"]["metadata"]["labels"]
    assert template_labels == {
        "team": "ml",
        km.NAME_LABEL: NAME,
        "app.kubernetes.io/managed-by": "ktlite",
    }


def test_annotations_go_on_the_pod_template() -> None:
    objs = _plan(K(annotations={"owner": "alice@example.com"})).manifests
    annotations = _sts(objs)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["owner"] == "alice@example.com"
    scrape = {k for k in annotations if k.startswith("prometheus.io/")}
    assert set(annotations) == {"owner", km.HASH_ANNOTATION, *scrape}


def test_pods_carry_the_usual_prometheus_scrape_annotations() -> None:
    from ktlite.backends.kube_pod_template import SERVER_PORT

    for encrypted, scheme in ((False, "http"), (True, "https")):
        objs = _plan(K(tls=encrypted)).manifests
        annotations = _sts(objs)["spec"]["template"]["metadata"]["annotations"]
        assert {k: v for k, v in annotations.items() if k.startswith("prometheus.io/")} == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(SERVER_PORT),
            "prometheus.io/path": "/metrics",
            "prometheus.io/scheme": scheme,
        }
    # the user's own annotation wins over ours
    mine = _plan(K(annotations={"prometheus.io/scrape": "false"})).manifests
    assert _sts(mine)["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == (
        "false"
    )


def test_secrets_become_env_from_secret_refs() -> None:
    container = _container(_plan(K(secrets=["hf-token", "wandb-creds"])).manifests)
    assert container["envFrom"] == [
        {"secretRef": {"name": "hf-token"}},
        {"secretRef": {"name": "wandb-creds"}},
    ]
    assert "envFrom" not in _container(_plan(K()).manifests)


def test_service_account_and_priority_class() -> None:
    pod = _pod(_plan(K(service_account="trainer", priority_class="high-priority")).manifests)
    assert pod["serviceAccountName"] == "trainer"
    assert pod["priorityClassName"] == "high-priority"
    default = _pod(_plan(K()).manifests)
    assert "serviceAccountName" not in default and "priorityClassName" not in default


@pytest.mark.parametrize("policy", ["Always", "IfNotPresent", "Never"])
def test_image_pull_policy(policy: str) -> None:
    assert _container(_plan(K(image_pull_policy=policy)).manifests)["imagePullPolicy"] == policy


def test_image_pull_policy_default_follows_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "imagePullPolicy" not in _container(_plan(K()).manifests)
    monkeypatch.setenv("KTLITE_IMAGE_PULL_POLICY", "Always")
    assert _container(_plan(K()).manifests)["imagePullPolicy"] == "Always"
    # an explicit Compute setting wins over the environment
    assert _container(_plan(K(image_pull_policy="Never")).manifests)["imagePullPolicy"] == "Never"


def test_shared_memory_is_a_memory_backed_empty_dir_at_dev_shm() -> None:
    objs = _plan(K(shared_memory="2Gi")).manifests
    volume = _pod_volumes(objs)[_mounts(objs)["/dev/shm"]]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    default = _plan(K()).manifests
    assert _pod_volumes(default)[_mounts(default)["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}


def test_the_pods_keep_budget_is_a_share_of_its_memory() -> None:
    """The warm files a pod keeps live in /dev/shm, memory counted against the pod: a pod with
    a memory limit (or request) or a sized /dev/shm is told its budget (an eighth of its
    memory, a quarter of its /dev/shm, 256 MiB at most); the Compute's own setting wins."""
    keep = "KTLITE_RECEIVE_KEEP_MB"
    assert _value(_plan(K(memory_limit="1Gi")).manifests, keep) == "128"
    assert _value(_plan(K(memory="512Mi")).manifests, keep) == "64"
    assert _value(_plan(K(memory="64Gi", shared_memory="400Mi")).manifests, keep) == "100"
    assert _value(_plan(K(memory_limit="64Gi")).manifests, keep) == "256"
    assert keep not in _env(_plan(K()).manifests)  # the pod derives it from what it sees
    assert _value(_plan(K(memory_limit="1Gi", env={keep: "32"})).manifests, keep) == "32"


def test_state_dir_is_an_empty_dir() -> None:
    objs = _plan(K()).manifests
    assert _pod_volumes(objs)[_mounts(objs)[km.STATE_DIR]]["emptyDir"] == {}


# ---- volumes -------------------------------------------------------------------------------------


def test_volume_becomes_a_claim_and_a_mount() -> None:
    objs = _plan(
        K(
            volumes=[
                kt.Volume(
                    "ckpt",
                    size="5Gi",
                    mount_path="/mnt/ckpt",
                    access_mode="ReadWriteOnce",
                    storage_class="fast-ssd",
                ),
                kt.Volume("data", size="20Gi"),
            ]
        )
    ).manifests
    claims = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PersistentVolumeClaim"}
    assert set(claims) == {"ckpt", "data"}
    assert claims["ckpt"]["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "fast-ssd",
    }
    assert claims["data"]["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "20Gi"}},
    }
    mounts, volumes = _mounts(objs), _pod_volumes(objs)
    assert volumes[mounts["/mnt/ckpt"]]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert volumes[mounts["/data"]]["persistentVolumeClaim"] == {"claimName": "data"}


def test_existing_claim_name_is_mounted_but_not_created() -> None:
    objs = _plan(K(volumes=["shared-datasets"])).manifests
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    mounts, volumes = _mounts(objs), _pod_volumes(objs)
    assert volumes[mounts["/shared-datasets"]]["persistentVolumeClaim"] == {
        "claimName": "shared-datasets"
    }


# ---- service and statefulset ---------------------------------------------------------------------


def test_service_is_headless_and_publishes_unready_pods() -> None:
    objs = _plan(K().distribute("pytorch", workers=2, port=23456)).manifests
    service = _one(objs, "Service")
    assert service["metadata"]["name"] == NAME
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is True
    assert spec["selector"] == {km.NAME_LABEL: NAME}
    assert {p["name"]: p["port"] for p in spec["ports"]} == {
        "server": km.SERVER_PORT,
        "master": 23456,
    }


def test_statefulset_shape() -> None:
    objs = _plan(K(cpus=1).distribute("pytorch", workers=4, num_proc=2, port=23456)).manifests
    sts = _sts(objs)
    assert sts["metadata"]["name"] == NAME
    spec = sts["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["replicas"] == 4
    assert spec["serviceName"] == NAME
    assert spec["updateStrategy"] == {"type": "OnDelete"}
    template_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    assert _one(objs, "Service")["spec"]["selector"].items() <= template_labels.items()
    container = _container(objs)
    assert container["command"] == ["/bin/sh", "-c", km.BOOTSTRAP]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "server": km.SERVER_PORT,
        "master": 23456,
    }
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/health",
        "port": km.SERVER_PORT,
        "scheme": "HTTPS",  # the pod serves only TLS (the kubelet does not verify it)
    }


def test_default_master_port_and_single_replica() -> None:
    objs = _plan(K()).manifests
    assert _sts(objs)["spec"]["replicas"] == 1
    assert {p["name"]: p["containerPort"] for p in _container(objs)["ports"]}["master"] == 29500


def test_bootstrap_is_valid_shell_that_ends_in_boot() -> None:
    proc = subprocess.run(
        ["sh", "-n", "-c", km.BOOTSTRAP], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert km.BOOTSTRAP.rstrip().endswith('exec "$PY" -m ktlite_server.boot')


def test_every_object_carries_the_name_and_managed_by_labels() -> None:
    for objs in (_plan(EVERYTHING()).manifests, _render(EVERYTHING(), namespace="ml-team")):
        for obj in objs:
            labels = obj["metadata"]["labels"]
            assert labels[km.NAME_LABEL] == NAME, obj["kind"]
            assert labels["app.kubernetes.io/managed-by"] == "ktlite", obj["kind"]
            assert obj["metadata"]["namespace"] == "ml-team", obj["kind"]
        assert _sts(objs)["spec"]["template"]["metadata"]["labels"][km.NAME_LABEL] == NAME


# ---- the token -----------------------------------------------------------------------------------


def test_plan_secret_holds_the_placeholder() -> None:
    plan = _plan(EVERYTHING())
    secret = _one(plan.manifests, "Secret")
    assert secret["metadata"]["name"] == f"{NAME}-token"
    shown = secret["stringData"]
    assert shown["token"] == km.TOKEN_PLACEHOLDER
    assert km.TOKEN_PLACEHOLDER in plan.yaml()
    # the boot files are described, not held: a plan stays short
    digest, bundle = shipped_source.source_bundle()
    assert digest in shown[kube_boot.SOURCE_KEY] and "KiB gzipped" in shown[kube_boot.SOURCE_KEY]
    assert len(plan.yaml()) < len(bundle) // 4
    # the TLS certificate and key: placeholders too, never the key
    assert shown["tls.crt"] == tls.CERT_PLACEHOLDER and shown["tls.key"] == tls.KEY_PLACEHOLDER
    assert "PRIVATE KEY" not in plan.yaml()


def test_token_appears_only_in_the_secret() -> None:
    objs = _render(EVERYTHING(), token=TOKEN)
    secret = _one(objs, "Secret")
    identity = tls.identity(TOKEN)
    assert secret["stringData"] == {"token": TOKEN}
    assert base64.b64decode(secret["data"]["tls.crt"]) == identity.cert_pem
    assert base64.b64decode(secret["data"]["tls.key"]) == identity.key_pem
    for obj in objs:
        if obj is not secret:
            assert TOKEN not in json.dumps(obj), obj["kind"]
            assert "PRIVATE KEY" not in json.dumps(obj), obj["kind"]
    assert TOKEN not in json.dumps({k: v for k, v in secret.items() if k != "stringData"})
    plan = _plan(EVERYTHING())
    assert TOKEN not in str(plan) and TOKEN not in plan.yaml()
    assert TOKEN not in json.dumps(plan.manifests)


def test_container_reads_the_token_from_a_file_of_the_secret_not_from_an_env_var() -> None:
    objs = _render(K(), token=TOKEN)
    env = _env(objs)
    assert "KTLITE_TOKEN" not in env
    assert not [e for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
    assert env["KTLITE_TOKEN_FILE"] == {
        "name": "KTLITE_TOKEN_FILE",
        "value": "/var/run/ktlite/token/token",
    }
    assert _pod_volumes(objs)["ktlite-token"]["secret"] == {
        "secretName": f"{NAME}-token",
        "defaultMode": 0o400,
        "items": [
            {"key": "token", "path": "token"},
            {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"},
        ],
    }
    assert {"name": "ktlite-token", "mountPath": "/var/run/ktlite/token", "readOnly": True} in (
        _container(objs)["volumeMounts"]
    )


# ---- container env -------------------------------------------------------------------------------


def test_user_env_and_image_env_become_container_env() -> None:
    image = kt.Image("python:3.11-slim").set_env_vars({"A": "image", "B": "image"})
    objs = _plan(K(image=image, env={"B": "compute", "C": "compute"})).manifests
    env = _env(objs)
    assert env["A"] == {"name": "A", "value": "image"}
    assert env["B"] == {"name": "B", "value": "compute"}  # Compute env wins over the image's
    assert env["C"] == {"name": "C", "value": "compute"}
    assert (
        _env(_plan(K(env_vars={"HF_HOME": "/data/hf"})).manifests)["HF_HOME"]["value"] == "/data/hf"
    )


def test_ktlite_env() -> None:
    env = _env(_plan(K()).manifests)
    assert env["KTLITE_DEPLOYMENT"]["value"] == NAME
    assert env["KTLITE_BACKEND"]["value"] == "kubernetes"
    assert env["KTLITE_PORT"]["value"] == str(km.SERVER_PORT)
    assert env["PYTHONUNBUFFERED"]["value"] == "1"
    assert env["KTLITE_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["KTLITE_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KTLITE_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_setup_steps_travel_in_the_token_secret_not_the_pod_spec() -> None:
    image = (
        kt.Image("python:3.11-slim")
        .pip_install(["--index-url", "https://me:s3cret@pypi.acme.dev/simple", "numpy"])
        .set_env_vars({"A": "1"})
        .run_bash("echo hi > /tmp/hi")
        .pip_install("tqdm")
    )
    objs = _render(K(image=image))
    secret = _one(objs, "Secret")
    assert json.loads(base64.b64decode(secret["data"][kube_boot.SETUP_KEY])) == [
        ["pip_install", ["--index-url", "https://me:s3cret@pypi.acme.dev/simple", "numpy"]],
        ["run_bash", "echo hi > /tmp/hi"],
        ["pip_install", ["tqdm"]],
    ]
    assert _value(objs, "A") == "1"
    assert _value(objs, kube_boot.SETUP_FILE_ENV) == f"{kube_boot.BOOT_DIR}/setup.json"
    sts = json.dumps(_one(objs, "StatefulSet"))
    assert "s3cret" not in sts and 'KTLITE_SETUP"' not in sts
    assert "s3cret" not in _plan(K(image=image)).yaml()
    # other steps, another digest: the pods are replaced
    other = _render(K(image=kt.Image("python:3.11-slim").pip_install("tqdm")))
    assert _value(other, kube_boot.SETUP_DIGEST_ENV) != _value(objs, kube_boot.SETUP_DIGEST_ENV)
    for compute in (K(), K(image=kt.Image("python:3.11-slim").set_env_vars({"A": "1"}))):
        rendered = _render(compute)
        assert kube_boot.SETUP_FILE_ENV not in _env(rendered)
        assert kube_boot.SETUP_KEY not in _one(rendered, "Secret")["data"]


def test_pods_get_ktlite_from_the_client_not_an_index() -> None:
    objs = _render(K())
    data = _one(objs, "Secret")["data"]
    digest, bundle = shipped_source.source_bundle()
    assert base64.b64decode(data[kube_boot.SOURCE_KEY]) == bundle
    assert _value(objs, kube_boot.SOURCE_DIGEST_ENV) == digest
    pod = _one(objs, "StatefulSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == kube_boot.BOOT_VOLUME]
    assert volume["secret"]["secretName"] == km.token_secret_name(NAME)
    assert volume["secret"]["defaultMode"] == 0o400
    mounts = {m["name"]: m for m in _container(objs)["volumeMounts"]}
    assert mounts[kube_boot.BOOT_VOLUME] == {
        "name": kube_boot.BOOT_VOLUME,
        "mountPath": kube_boot.BOOT_DIR,
        "readOnly": True,
    }
    assert "KTLITE_INSTALL" not in _env(objs)  # nothing is installed from an index


def test_freeze() -> None:
    frozen = kt.Image("acme/ready:1", freeze=True).pip_install("numpy")
    assert _value(_plan(K(image=frozen)).manifests, "KTLITE_FREEZE") == "1"
    assert _value(_plan(K(image="acme/ready:1")).manifests, "KTLITE_FREEZE") == "0"
    assert _value(_plan(K()).manifests, "KTLITE_FREEZE") == "0"


def test_install_spec_is_only_what_the_user_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "KTLITE_INSTALL" not in _env(_plan(K()).manifests)
    config.set_value("install", "ktlite==9.9.9")
    assert _value(_plan(K()).manifests, "KTLITE_INSTALL") == "ktlite==9.9.9"
    monkeypatch.setenv("KTLITE_INSTALL", "ktlite @ git+https://example.com/ktlite@main")
    assert (
        _value(_plan(K()).manifests, "KTLITE_INSTALL")
        == "ktlite @ git+https://example.com/ktlite@main"
    )


def test_default_image_is_this_python_and_follows_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _container(_plan(K()).manifests)["image"] == DEFAULT_IMAGE
    config.set_value("image", "registry.example.com/base:1")
    assert _container(_plan(K()).manifests)["image"] == "registry.example.com/base:1"
    monkeypatch.setenv("KTLITE_IMAGE", "ghcr.io/acme/base:2")
    assert _container(_plan(K()).manifests)["image"] == "ghcr.io/acme/base:2"
    # an image on the Compute wins
    assert (
        _container(_plan(K(image="ghcr.io/acme/train:3")).manifests)["image"]
        == "ghcr.io/acme/train:3"
    )


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        (lambda: "ghcr.io/acme/train:1.2", "ghcr.io/acme/train:1.2"),
        (lambda: kt.Image(base="ubuntu:24.04"), "ubuntu:24.04"),
        (lambda: kt.images.python("3.12"), "python:3.12-slim"),
        (lambda: kt.images.pytorch(), "nvcr.io/nvidia/pytorch:24.08-py3"),
        (lambda: kt.images.ray(), "rayproject/ray:2.60.0-py311"),
        (lambda: kt.images.debian(), "debian:bookworm-slim"),
    ],
    ids=["string", "base-kw", "python", "pytorch", "ray", "debian"],
)
def test_container_image(image: Callable[[], Any], ref: str) -> None:
    assert _container(_plan(K(image=image())).manifests)["image"] == ref


def test_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    def namespaces(compute: kt.Compute) -> set[str]:
        return {o["metadata"]["namespace"] for o in _plan(compute).manifests}

    assert namespaces(K()) == {"default"}
    assert namespaces(K(namespace="ml-team")) == {"ml-team"}
    monkeypatch.setenv("KTLITE_NAMESPACE", "from-env")
    assert namespaces(K()) == {"from-env"}
    assert namespaces(K(namespace="ml-team")) == {"ml-team"}  # the Compute wins


# ---- the pod hash --------------------------------------------------------------------------------


def BASE() -> kt.Compute:
    return K(cpus=1, memory="1Gi", image="python:3.11-slim", env={"A": "1"})


def test_pod_hash_is_stable() -> None:
    first, second = _plan(BASE()), _plan(BASE())
    assert _pod_hash(first.manifests) == _pod_hash(second.manifests)
    value = _pod_hash(first.manifests)
    assert len(value) == 16 and int(value, 16) >= 0


def test_pod_hash_is_stable_across_interpreters() -> None:
    code = (
        "import ktlite as kt\n"
        "def train(epochs=1):\n    return epochs\n"
        "compute = kt.Compute(backend='kubernetes', cpus=1, memory='1Gi',\n"
        "                     image='python:3.11-slim', env={'A': '1'})\n"
        "sts = kt.fn(train).to(compute, name='case-x', dryrun=True).manifests[-1]\n"
        "print(sts['spec']['template']['metadata']['annotations']['ktlite.dev/pod-hash'])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # the fixture's settings, another seed
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == _pod_hash(_plan(BASE()).manifests)


def test_code_change_touches_no_pod() -> None:
    # a redeploy of other code onto the same compute renders exactly the same objects
    assert _plan(BASE(), fn=train).manifests == _plan(BASE(), fn=evaluate).manifests


def test_layout_is_not_part_of_the_pod() -> None:
    small = _plan(BASE().distribute("pytorch", workers=1, num_proc=1)).manifests
    wide = _plan(BASE().distribute("pytorch", workers=4, num_proc=1)).manifests
    deep = _plan(BASE().distribute("pytorch", workers=1, num_proc=3)).manifests
    assert (
        _pod_hash(small) == _pod_hash(wide) == _pod_hash(deep) == _pod_hash(_plan(BASE()).manifests)
    )
    assert _sts(wide)["spec"]["replicas"] == 4


def test_uneven_cpu_pods_are_one_statefulset() -> None:
    # pods learn their rank count from the deploy message, so [1, 2] renders the same pod as
    # [2, 2]: without GPUs the pods do not differ, and one StatefulSet holds them
    uneven = _plan(BASE().distribute("pytorch", num_proc=[1, 2])).manifests
    assert _sts(uneven)["spec"]["replicas"] == 2
    assert "ordinals" not in _sts(uneven)["spec"]
    assert _pod_hash(uneven) == _pod_hash(_plan(BASE()).manifests)


def _statefulsets(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}


def _gpus(sts: dict[str, Any]) -> str:
    limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    requests = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
    return str(limits["nvidia.com/gpu"])


@pytest.mark.parametrize("version", VERSIONS)
def test_uneven_gpu_pods_get_one_statefulset_per_run_of_one_size(version: str) -> None:
    objs = _render(K(cpus=1, gpus=1).distribute("pytorch", num_proc=[4, 8, 8, 2]))
    assert [o["kind"] for o in objs] == [
        "Secret",
        "Service",
        "NetworkPolicy",
        "StatefulSet",
        "StatefulSet",
        "StatefulSet",
    ]
    for obj in objs:
        _validate(obj, version)
    sets = _statefulsets(objs)
    assert list(sets) == [NAME, f"{NAME}-s1", f"{NAME}-s3"]
    # (first ordinal, pods, GPUs per pod, rank processes started before code arrives)
    shape = [
        (
            (s["spec"].get("ordinals") or {}).get("start", 0),
            s["spec"]["replicas"],
            _gpus(s),
            next(
                e["value"]
                for e in s["spec"]["template"]["spec"]["containers"][0]["env"]
                if e["name"] == "KTLITE_PROCS"
            ),
        )
        for s in sets.values()
    ]
    assert shape == [(0, 1, "4", "4"), (1, 2, "8", "8"), (3, 1, "2", "2")]
    assert "ordinals" not in sets[NAME]["spec"]  # pod 0's set is the plain one
    hashes = set()
    for name, sts in sets.items():
        start = str((sts["spec"].get("ordinals") or {}).get("start", 0))
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector == {km.NAME_LABEL: NAME, km.PART_LABEL: start}, name
        template = sts["spec"]["template"]["metadata"]
        assert {k: template["labels"][k] for k in selector} == selector
        assert sts["metadata"]["labels"][km.NAME_LABEL] == NAME  # list/teardown find every set
        assert sts["spec"]["serviceName"] == NAME  # one headless Service for every pod
        hashes.add(template["annotations"][km.HASH_ANNOTATION])
    assert len(hashes) == 3


def test_uneven_gpu_pods_get_gpus_where_it_is_more_than_their_ranks() -> None:
    # gpus is the floor: pods of 4 and 2 ranks get 4, the pod of 8 ranks 8; the two pods of 4
    # GPUs are not neighbours, so they are two sets (their pods still differ by their label)
    sets = _statefulsets(_render(K(cpus=1, gpus=4).distribute("pytorch", num_proc=[4, 8, 2])))
    assert {name: (_gpus(s), s["spec"]["replicas"]) for name, s in sets.items()} == {
        NAME: ("4", 1),
        f"{NAME}-s1": ("8", 1),
        f"{NAME}-s2": ("4", 1),
    }
    hashes = {
        s["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION] for s in sets.values()
    }
    assert len(hashes) == 3
    # every pod at least as large as its ranks: one set, as for even pods
    same = _statefulsets(_render(K(cpus=1, gpus=8).distribute("pytorch", num_proc=[4, 8, 2])))
    assert list(same) == [NAME] and _gpus(same[NAME]) == "8"


def test_uneven_gpu_pods_need_a_name_that_leaves_room_for_their_sets() -> None:
    name = "n" * 50
    with pytest.raises(kt.ConfigError, match=r"too long for pods of different sizes.*at most 49"):
        kt.fn(train).to(K(gpus=1).distribute("pytorch", num_proc=[1, 2]), name=name, dryrun=True)
    # even pods keep the whole 52 characters
    assert isinstance(
        kt.fn(train).to(
            K(gpus=2).distribute("pytorch", num_proc=[2, 2]), name="n" * 52, dryrun=True
        ),
        Plan,
    )


def test_the_gpu_count_must_still_cover_each_rank_of_even_pods() -> None:
    with pytest.raises(kt.ConfigError, match="num_proc=4 has a pod of 4 ranks, more than gpus=2"):
        K(gpus=2).distribute("pytorch", workers=2, num_proc=4)


@pytest.mark.parametrize(
    "changed",
    [
        lambda: K(cpus=2, memory="1Gi", image="python:3.11-slim", env={"A": "1"}),
        lambda: K(cpus=1, memory="2Gi", image="python:3.11-slim", env={"A": "1"}),
        lambda: K(cpus=1, memory="1Gi", image="python:3.12-slim", env={"A": "1"}),
        lambda: K(cpus=1, memory="1Gi", image="python:3.11-slim", env={"A": "2"}),
        lambda: K(
            cpus=1,
            memory="1Gi",
            image=kt.Image("python:3.11-slim").pip_install("numpy"),
            env={"A": "1"},
        ),
        lambda: K(
            cpus=1,
            memory="1Gi",
            image=kt.Image("python:3.11-slim").run_bash("true"),
            env={"A": "1"},
        ),
        lambda: K(
            cpus=1,
            memory="1Gi",
            image="python:3.11-slim",
            env={"A": "1"},
            volumes=[kt.Volume("data")],
        ),
        lambda: K(
            cpus=1, memory="1Gi", image="python:3.11-slim", env={"A": "1"}, volumes=["existing"]
        ),
        lambda: K(cpus=1, memory="1Gi", image="python:3.11-slim", env={"A": "1"}, gpus=1),
        lambda: K(
            cpus=1,
            memory="1Gi",
            image="python:3.11-slim",
            env={"A": "1"},
            tolerations=[GPU_TOLERATION],
        ),
        lambda: K(
            cpus=1, memory="1Gi", image="python:3.11-slim", env={"A": "1"}, shared_memory="1Gi"
        ),
    ],
    ids=[
        "cpus",
        "memory",
        "image",
        "env",
        "pip-step",
        "bash-step",
        "volume",
        "existing-volume",
        "gpus",
        "tolerations",
        "shared-memory",
    ],
)
def test_pod_hash_changes_with_the_pod(changed: Callable[[], kt.Compute]) -> None:
    assert _pod_hash(_plan(changed()).manifests) != _pod_hash(_plan(BASE()).manifests)


# ---- YAML ----------------------------------------------------------------------------------------


def test_yaml_round_trips() -> None:
    plan = _plan(EVERYTHING())
    assert list(yaml.safe_load_all(plan.yaml())) == plan.manifests
    text = str(plan)
    assert text.splitlines()[0].startswith("# ")
    assert NAME in text.splitlines()[0]
    assert plan.yaml() in text
    assert list(yaml.safe_load_all(text)) == plan.manifests  # the comment is YAML too


# ---- bad input fails at construction -------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: K(memory="4 gigs"), ["memory", "4Gi"]),
        (lambda: K(memory="512m"), ["memory", "512Mi"]),
        (lambda: K(cpus=4, cpu_limit=2), ["cpu_limit", "cpus"]),
        (lambda: K(memory="4Gi", memory_limit="2Gi"), ["memory_limit", "memory"]),
        (lambda: K(image_pull_policy="sometimes"), ["image_pull_policy", "IfNotPresent"]),
        (
            lambda: kt.Volume("data", access_mode="ReadWriteSometimes"),
            ["access_mode", "ReadWriteMany"],
        ),
        (lambda: kt.Volume("data", size="10m"), ["Volume.size", "10Mi"]),
        (lambda: kt.Volume("data", size="lots"), ["Volume.size"]),
        (lambda: kt.Volume("data", mount_path="data"), ["mount_path", "absolute"]),
        (lambda: K(shared_memory="2 gigs"), ["shared_memory"]),
        (lambda: K(cpus="two"), ["cpus"]),
    ],
    ids=[
        "memory-Gb",
        "memory-mb",
        "cpu-limit-below",
        "memory-limit-below",
        "pull-policy",
        "access-mode",
        "volume-size-GB",
        "volume-size-words",
        "relative-mount",
        "shared-memory",
        "cpus-words",
    ],
)
def test_bad_input_fails_at_construction(make: Callable[[], Any], words: list[str]) -> None:
    with pytest.raises(kt.ConfigError) as info:
        make()
    for word in words:
        assert word in str(info.value)


# ---- input the API server would reject only at deploy time: refused before anything starts ---


def test_master_port_cannot_collide_with_the_server_port() -> None:
    with pytest.raises(kt.ConfigError, match="port=32300"):
        _plan(K().distribute("pytorch", port=km.SERVER_PORT))


@pytest.mark.parametrize(
    "volumes",
    [
        lambda: [kt.Volume("ktlite")],
        lambda: [kt.Volume("shm", mount_path="/dev/shm")],
        lambda: [kt.Volume("a", mount_path="/data"), kt.Volume("b", mount_path="/data")],
    ],
    ids=["state-dir", "dev-shm", "same-path"],
)
def test_volume_mount_paths_cannot_collide(volumes: Callable[[], list[Any]]) -> None:
    with pytest.raises(kt.ConfigError, match="mount"):
        K(volumes=volumes())


def test_memory_written_in_decimal_units_reaches_the_pod_as_a_quantity() -> None:
    """NeMo RL and Ray users write "8GB"; the API server only takes "8G" (issue 23)."""
    compute = K(
        memory="8GB",
        memory_limit="16gb",
        shared_memory="1GiB",
        volumes=[kt.Volume("data", size="20GB", mount_path="/data")],
    )
    objs = _plan(compute).manifests
    resources = _container(objs)["resources"]
    assert resources["requests"]["memory"] == "8G" and resources["limits"]["memory"] == "16G"
    assert _pod_volumes(objs)["ktlite-shm"]["emptyDir"]["sizeLimit"] == "1Gi"
    for obj in objs:
        _validate(obj, VERSIONS[-1])


def test_tiny_cpu_request_is_not_rounded_to_zero() -> None:
    objs = _plan(K(cpus=0.0001)).manifests
    assert _container(objs)["resources"]["requests"]["cpu"] == "1m"


def test_volume_name_must_be_a_kubernetes_name() -> None:
    with pytest.raises(kt.ConfigError, match="name"):
        kt.Volume("My_Data")
