"""Pure: an autoscaled :class:`DeploymentSpec` (``Compute.autoscale(...)``) → the Kubernetes
objects that serve it (plain dicts), in one of two forms, by what the cluster has:

- **Knative** (the CRD ``services.serving.knative.dev`` exists): a ``serving.knative.dev/v1``
  Service whose revision template carries Knative's autoscaling annotations
  (``AutoscaleConfig.annotations()``) and ``containerConcurrency``; Knative scales it,
  to zero too. Its pods use the downward API, so Knative's ``kubernetes.podspec-fieldref``
  feature must be enabled (as Kubetorch's chart does); volumes, node selectors and
  tolerations need their own ``kubernetes.podspec-*`` features.
- **HPA** (no Knative): a ``Deployment`` of replicas, a ClusterIP ``Service`` over the ready
  ones of the current template, and an ``autoscaling/v2 HorizontalPodAutoscaler``. It never
  goes below one replica (scale to zero needs Knative), and scales on CPU, or on the replicas'
  own in-flight calls (``ktlite_inflight_calls``) or call rate (``ktlite_calls_per_second``,
  an adapter's rate of ``ktlite_calls_total``) where a custom-metrics adapter serves them.

Both forms: the token Secret ``NAME-token``, a NetworkPolicy ``NAME`` (the server's port and,
with Knative, its queue-proxy's ports open; nothing else), and ``NAME-launch``, a Secret (made empty) that
holds the current launch (the pickled deploy message) as ``launch.pkl``, mounted read-only at
``LAUNCH_DIR``: a replica started later loads it at boot and reports ready
(``GET /health?ready=1``, the readiness probe) only once it has the code. Every replica is
rank 0 of a world of one (``KTLITE_POD_ORDINAL=0``). Everything is labelled
``ktlite.dev/name=NAME`` and ``ktlite.dev/mode=serve``. :func:`notes` says, in words, what the
cluster's capabilities change (shown at deploy time and in dry runs).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from ktlite.backends import kube_manifests as km
from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.secrets import Resolved

MODE_LABEL = "ktlite.dev/mode"
SERVE = "serve"
HASH_LABEL = "ktlite.dev/pod-hash"  # on served pods: the Service selects the current template's
LAUNCH_DIR = "/var/run/ktlite/launch"
LAUNCH_KEY = "launch.pkl"
LAUNCH_FILE = f"{LAUNCH_DIR}/{LAUNCH_KEY}"
LAUNCH_VOLUME = "ktlite-launch"
# a Secret holds at most 1 MiB (etcd's object limit), its metadata included
MAX_LAUNCH_BYTES = 1_000_000
DEFAULT_MAX_REPLICAS = 10  # an HPA needs a maximum; autoscale(max_scale=) sets another
DEFAULT_UTILIZATION = 80  # percent of the requested CPU (or memory) an HPA aims for
READY_PATH = "/health?ready=1"
AUTOSCALE_ANNOTATION = (
    "ktlite.dev/autoscale"  # on the Deployment / Knative Service: the config, as JSON
)
SPEC_ANNOTATION = "ktlite.dev/spec-digest"  # on the HPA: a digest of the spec ktlite asked for
INFLIGHT_METRIC = "ktlite_inflight_calls"
RATE_METRIC = (
    "ktlite_calls_per_second"  # what an adapter's rule names the rate of ktlite_calls_total
)
# Knative's queue-proxy: traffic (8012, h2c 8013), admin (8022), autoscaler metrics (9090),
# user metrics and profiling (9091)
KNATIVE_QUEUE_PORTS = (8012, 8013, 8022, 9090, 9091)
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/services.serving.knative.dev"
ADAPTER_PATH = "/apis/apiregistration.k8s.io/v1/apiservices/v1beta1.custom.metrics.k8s.io"


@dataclass(frozen=True)
class Capabilities:
    """What the cluster offers a served deployment."""

    knative: bool = False
    custom_metrics: bool = False  # an APIService v1beta1.custom.metrics.k8s.io that is Available

    @property
    def autoscaler(self) -> str:
        return "knative" if self.knative else "hpa"


def launch_secret_name(name: str) -> str:
    return f"{name}-launch"


def served_labels(name: str) -> dict[str, str]:
    return {**km.labels(name), MODE_LABEL: SERVE}


def quantity(value: float) -> str:
    """A number as a Kubernetes quantity: ``2``, ``700m``."""
    if value == int(value):
        return str(int(value))
    return f"{max(1, round(value * 1000))}m"


def _config(spec: DeploymentSpec) -> AutoscaleConfig:
    """The autoscaler's config of ``spec``: every function here takes a served deployment."""
    if spec.autoscale is None:
        raise ConfigError(f"deployment {spec.name!r} is not autoscaled: use compute.autoscale(...)")
    return spec.autoscale


# ---- what the cluster's capabilities change, in words ------------------------------------------


def _resource_metric(spec: DeploymentSpec) -> bool:
    """True when the HPA scales on CPU or memory (asked, or the fallback)."""
    return _config(spec).metric_name in ("cpu", "memory")


def notes(spec: DeploymentSpec, caps: Capabilities) -> list[str]:
    """Plain sentences on what this cluster makes of ``spec.autoscale``: empty when it gets
    what it asked for."""
    config = _config(spec)
    if caps.knative:
        return []
    out = []
    if config.min == 0:
        out.append(
            "min_scale=0: this cluster has no Knative Serving, so the HorizontalPodAutoscaler keeps "
            "at least 1 replica; install Knative Serving for scale to zero"
        )
    if config.max_scale is None:
        out.append(
            f"max_scale is not set and a HorizontalPodAutoscaler needs one: using {DEFAULT_MAX_REPLICAS} "
            "replicas (set autoscale(max_scale=...))"
        )
    if config.max_scale is not None and max(1, config.min) >= config.max_scale:
        return out  # a fixed count (Compute(replicas=N)): the HPA's metric never changes it
    metric = config.metric_name
    on_cpu = metric == "cpu"
    if metric in ("concurrency", "rps") and not caps.custom_metrics:
        series = INFLIGHT_METRIC if metric == "concurrency" else RATE_METRIC
        out.append(
            f"metric={metric!r} needs a custom-metrics adapter (APIService "
            f"v1beta1.custom.metrics.k8s.io, e.g. prometheus-adapter serving {series}); this cluster "
            f"has none, so the HorizontalPodAutoscaler scales on CPU instead, at {DEFAULT_UTILIZATION}% "
            "of the requested CPU (docs/kubernetes.md, 'Serving (autoscale)')"
        )
        on_cpu = True
    if on_cpu and spec.pod.resources.cpus is None:
        out.append(
            "the HorizontalPodAutoscaler scales on CPU utilization, which needs a CPU request: set "
            "Compute(cpus=...); without one it reports FailedGetResourceMetric and never scales"
        )
    if metric == "memory" and spec.pod.resources.memory is None:
        out.append(
            "metric='memory' scales on memory utilization, which needs a memory request: set "
            "Compute(memory=...)"
        )
    return out


# ---- the pods ----------------------------------------------------------------------------------


def pod_template(
    spec: DeploymentSpec,
    *,
    image: str,
    install: str,
    secrets: list[Resolved],
    token: str | None,
    knative: bool,
) -> dict[str, Any]:
    """The StatefulSet pods' template (containers, bootstrap, secrets, volumes: the same code),
    made a replica's: rank 0 of its own world, the launch Secret mounted, ready once it has code;
    re-hashed, and labelled with its hash (the Service selects only the current template's pods)."""
    template = km.pod_template(spec, image=image, install=install, secrets=secrets, token=token)
    meta, pod = template["metadata"], template["spec"]
    meta["annotations"].pop(km.HASH_ANNOTATION)
    meta["labels"][MODE_LABEL] = SERVE
    container = pod["containers"][0]
    env = [e for e in container["env"] if e["name"] != "KTLITE_POD_ORDINAL"]
    env.insert(3, {"name": "KTLITE_POD_ORDINAL", "value": "0"})
    env.insert(4, {"name": "KTLITE_LAUNCH_FILE", "value": LAUNCH_FILE})
    container["env"] = env
    # one port: Knative takes exactly one (named for its protocol); a replica has no peers
    container["ports"] = [
        {"name": "http1" if knative else "server", "containerPort": km.SERVER_PORT}
    ]
    container["readinessProbe"] = {
        "httpGet": {"path": READY_PATH, "port": km.SERVER_PORT},
        "periodSeconds": 1,
        "failureThreshold": 3,
        "timeoutSeconds": 2,
    }
    container["volumeMounts"].append(
        {"name": LAUNCH_VOLUME, "mountPath": LAUNCH_DIR, "readOnly": True}
    )
    pod["volumes"].append(
        {
            "name": LAUNCH_VOLUME,
            "secret": {
                "secretName": launch_secret_name(spec.name),
                "optional": True,
                "defaultMode": 0o400,
            },
        }
    )
    if knative:
        pod.pop(
            "terminationGracePeriodSeconds", None
        )  # Knative sets it from the revision's timeout
    return _hashed(template)


def _hashed(template: dict[str, Any]) -> dict[str, Any]:
    meta = template["metadata"]
    meta.setdefault("annotations", {}).pop(km.HASH_ANNOTATION, None)
    meta["labels"].pop(HASH_LABEL, None)
    digest = km.template_hash(template)
    meta["annotations"][km.HASH_ANNOTATION] = digest
    meta["labels"][HASH_LABEL] = digest
    return template


def template_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment or a Knative Service."""
    template: dict[str, Any] = obj["spec"]["template"]
    return template


# ---- the objects -------------------------------------------------------------------------------


def launch_secret(name: str, namespace: str) -> dict[str, Any]:
    """The launch Secret as apply makes it: empty (the client's first push fills it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": launch_secret_name(name),
            "namespace": namespace,
            "labels": served_labels(name),
        },
    }


def render(
    spec: DeploymentSpec,
    namespace: str,
    *,
    image: str,
    install: str,
    caps: Capabilities,
    token: str | None = None,
    secrets: list[Resolved] | None = None,
) -> list[dict[str, Any]]:
    """Every object serving ``spec`` applies, in apply order: the Secrets, the volumes' claims,
    then the Knative Service, or the Service, Deployment and HorizontalPodAutoscaler. Without
    ``token`` the token Secret holds a placeholder."""
    name = spec.name
    if secrets is None:
        secrets = km.resolve_secrets(spec, namespace)
    one = replace(
        spec, replicas=1
    )  # the replicas' one shape (an initial scale of 0 has none to render)
    base = km.render(one, namespace, image=image, install=install, token=token, secrets=secrets)
    token_secret = base[0]
    token_secret["metadata"]["labels"] = served_labels(name)
    kept = [
        o for o in base[2:] if o["kind"] in ("Secret", "PersistentVolumeClaim")
    ]  # user values, claims
    template = pod_template(
        one, image=image, install=install, secrets=secrets, token=token, knative=caps.knative
    )
    meta = {"name": name, "namespace": namespace, "labels": served_labels(name)}
    # the server's port to callers (a replica has no peers); Knative's activator and
    # autoscaler reach its queue-proxy sidecar
    policy = km.network_policy(name, meta, KNATIVE_QUEUE_PORTS if caps.knative else ())
    # what `kt.cls(name=...)` in another process reads back to serve it the same way
    workload_meta = {**meta, "annotations": {AUTOSCALE_ANNOTATION: autoscale_json(spec)}}
    if caps.knative:
        return [
            token_secret,
            launch_secret(name, namespace),
            *kept,
            policy,
            knative_service(spec, workload_meta, template),
        ]
    return [
        token_secret,
        launch_secret(name, namespace),
        *kept,
        policy,
        service(spec, meta, template),
        deployment(spec, workload_meta, template),
        hpa(spec, meta, caps),
    ]


def autoscale_json(spec: DeploymentSpec) -> str:
    return json.dumps(asdict(_config(spec)), sort_keys=True)


def autoscale_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The AutoscaleConfig fields a Deployment or Knative Service was made with (None: unknown)."""
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(AUTOSCALE_ANNOTATION)
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def service(spec: DeploymentSpec, meta: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A ClusterIP Service over the ready replicas of the current template (the API server's
    service proxy picks one of them)."""
    selector = {km.NAME_LABEL: spec.name, HASH_LABEL: template["metadata"]["labels"][HASH_LABEL]}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "server", "port": km.SERVER_PORT, "targetPort": km.SERVER_PORT}],
        },
    }


def initial_replicas(spec: DeploymentSpec) -> int:
    """The Deployment's first replica count: an HPA leaves a Deployment at zero alone."""
    return max(1, _config(spec).min, _config(spec).initial)


def deployment(
    spec: DeploymentSpec, meta: dict[str, Any], template: dict[str, Any]
) -> dict[str, Any]:
    selector = {km.NAME_LABEL: spec.name, MODE_LABEL: SERVE}
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **copy.deepcopy(meta),
            "labels": {**km.queue_label(spec.pod), **meta["labels"]},
        },
        "spec": {
            "replicas": initial_replicas(spec),
            "selector": {"matchLabels": selector},
            # a new replica comes up before an old one goes: serving never stops
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
            },
            "template": copy.deepcopy(template),
        },
    }
    if spec.pod.kubernetes.service_template:
        obj = _with_template(obj, spec.pod.kubernetes.service_template)
    return obj


def _with_template(obj: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``Compute(service_template=...)`` merged into a Deployment or Knative Service; ktlite's
    name, labels and selector stay its own and the pod hash is taken again."""
    merged = km.merge_template(obj, extra)
    merged["metadata"] = {
        **merged["metadata"],
        "name": obj["metadata"]["name"],
        "namespace": obj["metadata"]["namespace"],
        "labels": {**merged["metadata"].get("labels", {}), **obj["metadata"]["labels"]},
    }
    if "selector" in obj["spec"]:
        merged["spec"]["selector"] = obj["spec"]["selector"]
    template = merged["spec"]["template"]
    own = obj["spec"]["template"]["metadata"]["labels"]
    template["metadata"]["labels"] = {**template["metadata"].get("labels", {}), **own}
    _hashed(template)
    return merged


def hpa_metric(spec: DeploymentSpec, caps: Capabilities) -> dict[str, Any]:
    """The HPA's one metric: CPU/memory utilization, or the replicas' own load through a
    custom-metrics adapter (CPU where there is none; :func:`notes` says so)."""
    config = _config(spec)
    metric = config.metric_name
    if metric in ("concurrency", "rps") and caps.custom_metrics:
        series = INFLIGHT_METRIC if metric == "concurrency" else RATE_METRIC
        return {
            "type": "Pods",
            "pods": {
                "metric": {"name": series},
                "target": {
                    "type": "AverageValue",
                    "averageValue": quantity(config.target_per_replica),
                },
            },
        }
    resource = metric if metric in ("cpu", "memory") else "cpu"
    if resource == metric and config.target is not None:
        percent = config.target
    elif resource == metric and config.target_utilization is not None:
        percent = config.target_utilization
    else:
        percent = DEFAULT_UTILIZATION
    return {
        "type": "Resource",
        "resource": {
            "name": resource,
            "target": {"type": "Utilization", "averageUtilization": max(1, int(round(percent)))},
        },
    }


def hpa(spec: DeploymentSpec, meta: dict[str, Any], caps: Capabilities) -> dict[str, Any]:
    config = _config(spec)
    low = max(1, config.min)
    high = max(low, config.max_scale if config.max_scale is not None else DEFAULT_MAX_REPLICAS)
    hpa_spec = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
        "minReplicas": low,
        "maxReplicas": high,
        "metrics": [hpa_metric(spec, caps)],
        "behavior": {
            "scaleDown": {"stabilizationWindowSeconds": min(3600, int(config.scale_down_delay_s))}
        },
    }
    # the API server fills in defaults (scaling policies): this digest says whether ours changed
    digest = km.template_hash({"spec": hpa_spec})
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {**copy.deepcopy(meta), "annotations": {SPEC_ANNOTATION: digest}},
        "spec": hpa_spec,
    }


def knative_service(
    spec: DeploymentSpec, meta: dict[str, Any], template: dict[str, Any]
) -> dict[str, Any]:
    """A Knative Service: the replicas' pod spec, one port, ``containerConcurrency`` (the
    most calls a replica runs at once) and the autoscaling annotations on its revisions."""
    config = _config(spec)
    template = copy.deepcopy(template)
    annotations = {**template["metadata"]["annotations"], **config.annotations()}
    if config.progress_deadline is not None:
        from ktlite.specs.autoscaling import _knative

        annotations["serving.knative.dev/progress-deadline"] = _knative(config.progress_deadline)
    template["metadata"]["annotations"] = annotations
    template["spec"] = {"containerConcurrency": spec.concurrency, **template["spec"]}
    obj = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": copy.deepcopy(meta),
        "spec": {"template": _hashed(template)},
    }
    if spec.pod.kubernetes.service_template:
        obj = _with_template(obj, spec.pod.kubernetes.service_template)
    return obj
