"""Pure: the pod template of a deployment's StatefulSet (a plain dict), and the parts it has.

Each secret given by value or preset (``Compute(secrets=["aws", kt.secret(...)])``) is read by
the pods as ``env[].valueFrom.secretKeyRef`` or as read-only files (``subPath`` mounts of a
secret volume) at the provider's path under ``POD_HOME``; an existing Secret named alone is
``envFrom``. Plans hold placeholders, never values.

Pods of different sizes (a GPU deployment with ``num_proc=[4, 8, 2]``: 4, 8 and 2 GPUs) cannot
share a pod template, so such a deployment has one StatefulSet per run of pods of one size
(:func:`parts`). Pods that differ only in rank count do not differ as pods (they learn their
ranks from the deploy message), so a CPU deployment with uneven ``num_proc`` stays one part.

The container starts with a short shell bootstrap that finds the image's Python and unpacks the
source of ktlite the client shipped in the token Secret (:mod:`ktlite.backends.kube_boot`; with
``freeze=True`` the image's own ktlite runs instead), then runs ``python -m ktlite_server.boot``,
which runs the image's setup steps (from the same Secret) and execs the server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ktlite.backends import kube_boot, kube_tls
from ktlite.backends.kube_boot import UNPACK_SOURCE
from ktlite.backends.kube_deps import UNPACK_DEPS
from ktlite.backends.kube_expiry import give_pod
from ktlite.backends.kube_labels import (
    GPU_MEMORY_ANNOTATION,
    HASH_ANNOTATION,
    NAME_LABEL,
    PART_LABEL,
    SECRETS_ANNOTATION,
    labels,
    queue_label,
    template_hash,
    token_secret_name,
    user_secret_name,
)
from ktlite.backends.kube_security import (
    LINK_SECRET_FILES,
    LINKS_ENV,
    POD_HOME,
    SECRETS_DIR,
    harden,
)
from ktlite.backends.kube_security import env as security_env
from ktlite.errors import ConfigError
from ktlite.logconfig import pod_env
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.podspec import PodSpec, Resources
from ktlite.specs.secrets import Resolved, fingerprint, for_pod
from ktlite.specs.spec import DEFAULT_MASTER_PORT
from ktlite.specs.volume import Volume
from ktlite_wire import keepbudget

SERVER_PORT = 32300


def scrape_annotations(tls: bool) -> dict[str, str]:
    """The usual Prometheus annotations: the pod server's ``/metrics``, which a scrape job
    reaches with the deployment token (``docs/metrics.md``)."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(SERVER_PORT),
        "prometheus.io/path": "/metrics",
        "prometheus.io/scheme": "https" if tls else "http",
    }


STATE_DIR = "/ktlite"  # an emptyDir: survives container restarts, not pod replacement
SETUP_FAILED_EXIT = 78  # the bootstrap's exit code when a setup step or the ktlite install fails
TOKEN_PLACEHOLDER = "<generated at deploy time>"
CONTAINER = "ktlite"
MAX_STATEFULSET_NAME = 52  # its pods' controller-revision-hash label adds 11 characters to 63


# Finds the image's Python and gives it ktlite: the source the client shipped (kube_boot),
# the image's own (freeze=True), or what KTLITE_INSTALL names, installed from the package
# index only because the user set it; everything else happens in ktlite_server.boot.
BOOTSTRAP = (
    "set -e\n"
    + LINK_SECRET_FILES
    + r"""if [ -n "$KTLITE_PYTHON" ]; then PY=$KTLITE_PYTHON
else PY=$(command -v python3 || command -v python || true); fi
if [ -z "$PY" ]; then
  echo "ktlite: the image ${KTLITE_IMAGE:-} has no python3 or python on PATH: use an image with Python 3.10 or newer, or name its interpreter with kt.Image(python_path=...)" >&2
  exit 78
fi
if [ -n "$KTLITE_INSTALL" ]; then
  VENV=${KTLITE_STATE_DIR:-/ktlite}/venv
  if "$VENV/bin/python" -c 'import ktlite_server' 2>/dev/null; then PY=$VENV/bin/python
  elif ! "$PY" -c 'import ktlite_server' 2>/dev/null; then
    echo "ktlite: installing $KTLITE_INSTALL from the package index (KTLITE_INSTALL asks for it)"
    "$PY" -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$KTLITE_INSTALL" \
      || { echo "ktlite: could not install $KTLITE_INSTALL" >&2; exit 78; }
    PY=$VENV/bin/python
  fi
elif [ "$KTLITE_FREEZE" = 1 ]; then
  if ! "$PY" -c 'import ktlite_server' 2>/dev/null; then
    echo "ktlite: this image has no ktlite (python: $PY) and freeze=True runs only what the image has: use an image with ktlite installed, or freeze=False to run the client's own (shipped with the deployment)" >&2
    exit 78
  fi
else
"""
    + UNPACK_SOURCE
    + UNPACK_DEPS
    + """fi
if [ -z "$KTLITE_WORKDIR" ] && [ ! -w . ]; then
  echo "ktlite: the image's working directory $PWD is not writable by user $(id -u): user code runs in $HOME (Compute(working_dir=...) names another)"
  export KTLITE_WORKDIR="$HOME"
fi
exec "$PY" -m ktlite_server.boot
"""
)


def resolve_secrets(spec: DeploymentSpec, namespace: str) -> list[Resolved]:
    """The pod spec's secrets, read (ConfigError when a preset finds nothing), in ``namespace``."""
    return for_pod(spec.pod.secrets, spec.pod.merged_env, "kubernetes", namespace, existing=True)


def _secret_wiring(
    name: str, secrets: list[Resolved], token: str | None
) -> tuple[
    list[dict[str, Any]],
    list[dict[str, Any]],
    list[dict[str, Any]],
    list[dict[str, Any]],
    dict[str, str],
]:
    """(env, envFrom, volumes, mounts, annotations) that give a pod its secrets."""
    env: list[dict[str, Any]] = []
    env_from: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    links: list[str] = []
    for i, r in enumerate(secrets):
        if r.existing:
            env_from.append({"secretRef": {"name": r.existing}})
            continue
        obj = user_secret_name(name, r.key)
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": obj, "key": k}}} for k in r.env]
        if r.files:
            volume = f"secret-{i}"
            volumes.append(
                {
                    "name": volume,
                    "secret": {
                        "secretName": obj,
                        "defaultMode": 0o400,
                        "items": [{"key": f.key, "path": f.key, "mode": f.mode} for f in r.files],
                    },
                }
            )
            # the volume in a directory of ktlite's, each file linked to from its place in the
            # home by the bootstrap: the directories there stay the user's (~/.ssh: known_hosts)
            mounts.append(
                {"name": volume, "mountPath": f"{SECRETS_DIR}/{volume}", "readOnly": True}
            )
            for f in r.files:
                path = f"{POD_HOME}/{f.pod_path}"
                links.append(f"{path}={SECRETS_DIR}/{volume}/{f.key}")
                if f.pointer:
                    env.append({"name": f.pointer, "value": path})
    if links:
        env.append({"name": LINKS_ENV, "value": "\n".join(links)})
    values = [r for r in secrets if not r.existing]
    annotations = (
        {SECRETS_ANNOTATION: fingerprint(values, token) if token is not None else TOKEN_PLACEHOLDER}
        if values
        else {}
    )
    return env, env_from, volumes, mounts, annotations


def master_port(spec: DeploymentSpec) -> int:
    port = spec.distributed.port or DEFAULT_MASTER_PORT
    if port == SERVER_PORT:
        raise ConfigError(
            f"distribute(port={port}) is the port of ktlite's own server on a pod; "
            "pick another MASTER_PORT, e.g. 29500"
        )
    return port


def cpu_quantity(cpus: float) -> str:
    # Kubernetes' smallest CPU unit is 1m; round up so a tiny request never becomes zero
    return str(int(cpus)) if cpus == int(cpus) else f"{max(1, math.ceil(cpus * 1000))}m"


def setup_steps(spec: DeploymentSpec) -> list[list[Any]]:
    """The image's pip/bash steps as JSON for ``ktlite_server.boot`` (env steps become env)."""
    image = spec.pod.image
    if image is None:
        return []
    return [
        [kind, list(arg) if kind == "pip_install" else arg]
        for kind, arg in image.steps
        if kind in ("pip_install", "run_bash")
    ]


@dataclass(frozen=True)
class Part:
    """A run of pods ``start .. start + replicas - 1`` alike as pods: one StatefulSet."""

    name: str
    start: int
    replicas: int
    gpus: int
    labelled: bool  # one of several: selects its pods by PART_LABEL too
    pod: PodSpec | None = None  # its pods' spec (a Ray worker node's own); None: the deployment's


def parts(spec: DeploymentSpec) -> list[Part]:
    """The deployment's StatefulSets: one, or one per run of pods alike (the same GPU count;
    for Ray, the head and the worker nodes sized by ``worker_node_options``)."""
    runs: list[list[Any]] = []  # [start, replicas, gpus, pod, key]
    for ordinal in range(spec.workers):
        gpus = spec.pod.pod_gpus(ordinal)
        pod = spec.pod.for_ordinal(ordinal)
        shape = {k: v for k, v in pod.shape().items() if k != "worker"}
        key = (gpus, json.dumps(shape, sort_keys=True, default=repr))
        if runs and runs[-1][4] == key:
            runs[-1][1] += 1
        else:
            runs.append([ordinal, 1, gpus, pod, key])
    several = len(runs) > 1
    out = [
        Part(
            name=spec.name if start == 0 else f"{spec.name}-s{start}",
            start=start,
            replicas=replicas,
            gpus=gpus,
            labelled=several,
            pod=pod,
        )
        for start, replicas, gpus, pod, _ in runs
    ]
    for part in out:
        if len(part.name) > MAX_STATEFULSET_NAME:
            raise ConfigError(
                f"deployment name {spec.name!r} is too long for pods of different sizes: their "
                f"StatefulSet {part.name!r} would exceed {MAX_STATEFULSET_NAME} characters (its pods' "
                f"names and revision labels must fit 63); use a name of at most "
                f"{MAX_STATEFULSET_NAME - len(part.name) + len(spec.name)} characters"
            )
    return out


def part_selector(spec_name: str, part: Part) -> dict[str, str]:
    return (
        {NAME_LABEL: spec_name, PART_LABEL: str(part.start)}
        if part.labelled
        else {NAME_LABEL: spec_name}
    )


def _resources(res: Resources, gpus: int) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpus is not None:
        requests["cpu"] = cpu_quantity(res.cpus)
    if res.memory is not None:
        requests["memory"] = res.memory.quantity
    if res.cpu_limit is not None:
        limits["cpu"] = cpu_quantity(res.cpu_limit)
    if res.memory_limit is not None:
        limits["memory"] = res.memory_limit.quantity
    if res.disk_size is not None:
        requests["ephemeral-storage"] = res.disk_size.quantity
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(pod: PodSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts): ktlite's state dir, /dev/shm, then the user's volumes."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if pod.resources.shared_memory is not None:
        shm["sizeLimit"] = pod.resources.shared_memory.quantity
    volumes: list[dict[str, Any]] = [
        {"name": "ktlite-state", "emptyDir": {}},
        {"name": "ktlite-shm", "emptyDir": shm},
    ]
    mounts = [
        {"name": "ktlite-state", "mountPath": STATE_DIR},
        {"name": "ktlite-shm", "mountPath": "/dev/shm"},
    ]
    for i, vol in enumerate(pod.volumes):
        claim, path = (vol.name, vol.mount_path) if isinstance(vol, Volume) else (vol, f"/{vol}")
        volumes.append({"name": f"vol-{i}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"vol-{i}", "mountPath": path})
    return volumes, mounts


def _env(spec: DeploymentSpec, install: str, gpus: int) -> list[dict[str, Any]]:
    image = spec.pod.image

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "KTLITE_POD_NAME", **field("metadata.name")},
        {"name": "KTLITE_POD_IP", **field("status.podIP")},
        {"name": "KTLITE_POD_ORDINAL", **field("metadata.labels['apps.kubernetes.io/pod-index']")},
        {"name": "KTLITE_NAMESPACE", **field("metadata.namespace")},
        {"name": "KTLITE_DEPLOYMENT", "value": spec.name},
        {"name": "KTLITE_BACKEND", "value": "kubernetes"},
        {"name": "KTLITE_PORT", "value": str(SERVER_PORT)},
        {"name": "KTLITE_PROCS", "value": str(max(gpus, 1))},
        # a pip spec the user asked to install instead of the shipped source (none by default)
        *([{"name": "KTLITE_INSTALL", "value": install}] if install else []),
        {
            "name": "KTLITE_FREEZE",
            "value": "1" if spec.pod.freeze or (image is not None and image.freeze) else "0",
        },
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # the token's path, HOME (unless the Compute's env sets it: its entry comes later)
        *(e for e in security_env() if e["name"] not in spec.pod.merged_env),
        # KTLITE_LOG_LEVEL
        *({"name": k, "value": v} for k, v in pod_env().items() if k not in spec.pod.env),
    ]
    env += _keep_env(spec.pod)
    if image is not None and image.python_path:
        env.append({"name": "KTLITE_PYTHON", "value": image.python_path})
    if image is not None and image.install_cmd:
        env.append({"name": "KTLITE_PIP_CMD", "value": image.install_cmd})
    env += [{"name": k, "value": v} for k, v in spec.pod.merged_env.items()]
    return env


def _keep_env(pod: PodSpec) -> list[dict[str, Any]]:
    """``KTLITE_RECEIVE_KEEP_MB`` for a pod with a memory limit (or request) or a sized
    ``/dev/shm``: the warm files its processes keep are in ``/dev/shm``, memory counted against
    the pod, so they keep at most the share the pod would derive itself (``keepbudget.derive``:
    an eighth of its memory, a quarter of its ``/dev/shm``, 256 MiB). The Compute's own setting
    wins."""
    res = pod.resources
    memory = res.memory_limit or res.memory
    if (memory is None and res.shared_memory is None) or keepbudget.KEEP_ENV in pod.merged_env:
        return []
    budget = keepbudget.derive(
        memory.bytes if memory else None, res.shared_memory.bytes if res.shared_memory else None
    )
    return [{"name": keepbudget.KEEP_ENV, "value": str(budget >> 20)}]


def pod_template(
    spec: DeploymentSpec,
    *,
    image: str,
    install: str,
    part: Part | None = None,
    secrets: list[Resolved] | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """The pod template of ``part`` (default: the StatefulSet holding pod 0), annotated with a
    hash of itself. ``secrets``: the Compute's, read (default: read now); ``token`` keys the
    digest of their values (a plan, without it, shows a placeholder)."""
    part = part or parts(spec)[0]
    pod_spec = part.pod or spec.pod
    kube = pod_spec.kubernetes
    res = pod_spec.resources
    if secrets is None:
        secrets = resolve_secrets(spec, "default")
    volumes, mounts = _volumes(pod_spec)
    secret_env, env_from, secret_volumes, secret_mounts, secret_notes = _secret_wiring(
        spec.name, secrets, token
    )
    volumes += secret_volumes
    mounts += secret_mounts
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["/bin/sh", "-c", BOOTSTRAP],
        # the pod names its image in errors (e.g. Ray missing from it)
        "env": [
            *_env(spec, install, part.gpus),
            *secret_env,
            {"name": "KTLITE_IMAGE", "value": image},
        ],
        "ports": [
            {"name": "server", "containerPort": SERVER_PORT},
            {"name": "master", "containerPort": master_port(spec)},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": SERVER_PORT},
            "periodSeconds": 1,
            "failureThreshold": 3,
            "timeoutSeconds": 2,
        },
        "volumeMounts": mounts,
    }
    if env_from:
        container["envFrom"] = env_from
    resources = _resources(res, part.gpus)
    if resources:
        container["resources"] = resources
    if kube.image_pull_policy:
        container["imagePullPolicy"] = kube.image_pull_policy
    if pod_spec.working_dir:
        container["workingDir"] = pod_spec.working_dir
        container["env"].append({"name": "KTLITE_WORKDIR", "value": pod_spec.working_dir})
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 15,
    }
    harden(pod, kube, token_secret_name(spec.name))
    kube_boot.wire(pod, token_secret_name(spec.name), setup_steps(spec), token)
    if kube_tls.wanted(spec):  # the certificate beside the token, the probe over HTTPS
        kube_tls.secure(pod)
    give_pod(pod, spec, [p.name for p in parts(spec)], secrets)  # inactivity_ttl's
    if kube.gpu_anti_affinity and not part.gpus:  # a CPU-only pod stays off GPU nodes
        pod["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}
                            ]
                        }
                    ]
                }
            }
        }
    node_selector = dict(kube.node_selector)
    if res.gpu_type:
        node_selector["nvidia.com/gpu.product"] = res.gpu_type
    if node_selector:
        pod["nodeSelector"] = node_selector
    if kube.tolerations:
        pod["tolerations"] = [dict(t) for t in kube.tolerations]
    if kube.service_account:
        pod["serviceAccountName"] = kube.service_account
    if kube.priority_class:
        pod["priorityClassName"] = kube.priority_class
    meta = {
        "labels": {
            **kube.labels,
            **queue_label(pod_spec),
            **labels(spec.name),
            **part_selector(spec.name, part),
        },
        "annotations": {
            **scrape_annotations(kube_tls.wanted(spec)),
            **kube.annotations,
            **secret_notes,
        },
    }
    if res.gpu_memory:
        meta["annotations"][GPU_MEMORY_ANNOTATION] = res.gpu_memory.quantity
    template = {"metadata": meta, "spec": pod}
    meta["annotations"][HASH_ANNOTATION] = template_hash(template)
    return template
