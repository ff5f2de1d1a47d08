"""What the cluster reports of the Kubernetes backend's autoscaled deployments
(``Compute.autoscale``): their objects, the replicas that run (as endpoints), the
autoscaler's status and the rows ``ktlite list`` shows.

Mixed into :class:`~ktlite.backends.kubernetes.KubernetesBackend` (through
:class:`~ktlite.backends.kube_served.ServedDeployments`), whose helpers it uses. Kinds only
served deployments use (Knative's, the HPA) are read so that a cluster without them, or an
account that may not read them, has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_secrets as ksec
from ktlite.backends import kube_serving as kss
from ktlite.backends.base import Applied, PodEndpoint
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.specs.spec import DEFAULT_MASTER_PORT

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object


def pod_hash(obj: dict[str, Any]) -> str | None:
    value: str | None = ((obj.get("metadata") or {}).get("annotations") or {}).get(
        km.HASH_ANNOTATION
    )
    return value


def call_port(pod: dict[str, Any]) -> int:
    """The port calls reach a replica on: Knative's queue-proxy (which counts the calls
    Knative's autoscaler scales on, and holds a replica to ``containerConcurrency``) where
    Knative injected one, else the pod server's own."""
    for container in pod.get("spec", {}).get("containers", []):
        if container.get("name") == "queue-proxy":
            ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
            return int(ports.get("queue-port") or 8012)
    return km.SERVER_PORT


def _alive(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and not pod["metadata"].get("deletionTimestamp")
    )


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {k: c.get(k, "") for k in ("type", "status", "reason", "message")}
        for c in (obj.get("status") or {}).get("conditions") or []
    ]


def peek(api: KubeApi, kind: str, name: str) -> dict[str, Any] | None:
    """``api.get`` for the kinds only served deployments use: None also where this account may
    not read them (403: it cannot have made any) or the cluster does not serve the kind (404)."""
    try:
        return api.get(kind, name)
    except KubeApiError as e:
        if e.status in (403, 404):
            return None
        raise


def scan(api: KubeApi, kind: str, selector: str) -> list[dict[str, Any]]:
    """``api.list`` of such a kind: empty where it may not be read or is not served."""
    try:
        return api.list(kind, selector)
    except KubeApiError as e:
        if e.status in (403, 404):
            return []
        raise


def is_served(obj: dict[str, Any] | None, name: str) -> bool:
    """``obj`` is a served deployment's object ktlite made for ``name``."""
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(km.NAME_LABEL) == name and labels.get(kss.MODE_LABEL) == kss.SERVE


def _describe_metric(
    spec: dict[str, Any], status: dict[str, Any], deployment: dict[str, Any] | None
) -> dict[str, Any]:
    """The HPA's metric, its target and the value it last read (None: none read); with
    ``instead_of``, the metric the deployment asked for where the HPA scales on CPU in its
    place (a cluster without a custom-metrics adapter)."""
    metric = (spec.get("metrics") or [{}])[0]
    current = (status.get("currentMetrics") or [{}])[0]
    if metric.get("type") == "Resource":
        target = metric["resource"]["target"]
        value = ((current.get("resource") or {}).get("current") or {}).get("averageUtilization")
        out = {
            "name": metric["resource"]["name"],
            "target": f"{target.get('averageUtilization')}%",
            "current": None if value is None else f"{value}%",
        }
        asked = ((kss.autoscale_of(deployment or {}) or {}).get("metric")) or "concurrency"
        if asked != out["name"]:
            out["instead_of"] = asked  # what kss.notes announced at deploy time
        return out
    if metric.get("type") == "Pods":
        value = ((current.get("pods") or {}).get("current") or {}).get("averageValue")
        return {
            "name": metric["pods"]["metric"]["name"],
            "target": metric["pods"]["target"].get("averageValue"),
            "current": value,
        }
    return {"name": metric.get("type"), "target": None, "current": None}


class ServedStatus(_Base):
    """The served deployments as the cluster reports them (mixed into the backend)."""

    @property
    def _served_names(self) -> set[str]:
        """Names this backend object found served (lookup asks for their kind first)."""
        names: set[str] = self.__dict__.setdefault("_served_names_set", set())
        return names

    def _served_object(self, api: KubeApi, name: str) -> dict[str, Any] | None:
        """The Deployment or Knative Service of the served deployment ``name``, or None."""
        for kind in ("Deployment", "KnativeService"):
            obj = peek(api, kind, name)
            if is_served(obj, name):
                return obj
        return None

    def _knative_ready(self, api: KubeApi, name: str) -> bool:
        ksvc = api.get("KnativeService", name) or {}
        return any(c["type"] == "Ready" and c["status"] == "True" for c in _conditions(ksvc))

    def _applied_served(
        self,
        name: str,
        pods: list[dict[str, Any]],
        token: str,
        spec_hash: str,
        autoscale: dict[str, Any] | None,
        before: set[str] | None = None,
    ) -> Applied:
        """Replicas by name; ordinal = place in that order (replicas have no ordinals of their own)."""
        api = self._api()
        http, info = self._connect()
        endpoints, restarted = [], []
        for i, pod in enumerate(sorted(pods, key=lambda p: p["metadata"]["name"])):
            ip, pod_name = pod["status"].get("podIP", ""), pod["metadata"]["name"]
            peer = kp.url(ip, km.SERVER_PORT)
            port = call_port(pod)
            endpoints.append(
                PodEndpoint(
                    name=pod_name,
                    ordinal=i,
                    ip=ip,
                    peer_url=peer,
                    url=kp.url(ip, port) if info.in_cluster else api.proxy_url(pod_name, port),
                    incarnation=kp.incarnation(pod),
                )
            )
            if before is not None and pod["metadata"]["uid"] not in before:
                restarted.append(i)
        return Applied(
            name=name,
            backend=self.name,
            endpoints=endpoints,
            token=token,
            master_port=DEFAULT_MASTER_PORT,
            restarted=restarted,
            http=None if info.in_cluster else http,
            spec_hash=spec_hash,
            autoscale=autoscale,
        )

    def _lookup_served(self, api: KubeApi, name: str) -> Applied | None:
        obj = self._served_object(api, name)
        secret = api.get("Secret", km.token_secret_name(name))
        if obj is None or secret is None:
            return None
        token = ksec.decode_token(secret)
        if token is None:
            return None
        want = pod_hash(kss.template_of(obj)) or ""
        pods = [p for p in api.list("Pod", km.selector(name)) if pod_hash(p) == want and _alive(p)]
        self._served_names.add(name)
        return self._applied_served(name, pods, token, want, kss.autoscale_of(obj))

    def scaling_status(self, name: str) -> dict[str, Any] | None:
        """What the cluster's autoscaler says: replicas now and wanted, its bounds, when it last
        scaled, its conditions (e.g. FailedGetResourceMetric without metrics-server) and its
        metric; None for a deployment that is not served."""
        api = self._api()
        hpa = peek(api, "HorizontalPodAutoscaler", name)
        if is_served(hpa, name):
            assert hpa is not None
            spec, status = hpa["spec"], hpa.get("status") or {}
            return {
                "autoscaler": "hpa",
                "current": status.get("currentReplicas", 0),
                "desired": status.get("desiredReplicas", 0),
                "min": spec.get("minReplicas", 1),
                "max": spec.get("maxReplicas"),
                "last_scale_time": status.get("lastScaleTime"),
                "conditions": _conditions(hpa),
                "metric": _describe_metric(spec, status, peek(api, "Deployment", name)),
            }
        ksvc = peek(api, "KnativeService", name)
        if not is_served(ksvc, name):
            return None
        assert ksvc is not None
        status = ksvc.get("status") or {}
        notes = kss.template_of(ksvc)["metadata"].get("annotations") or {}
        prefix = "autoscaling.knative.dev/"
        revision = status.get("latestCreatedRevisionName")
        scaler = (peek(api, "PodAutoscaler", revision) or {}) if revision else {}
        pods = [p for p in api.list("Pod", km.selector(name)) if _alive(p)]
        scaler_status = scaler.get("status") or {}
        return {
            "autoscaler": "knative",
            "current": scaler_status.get("actualScale", len(pods)),
            "desired": scaler_status.get("desiredScale"),
            "min": int(notes.get(prefix + "min-scale", 0)),
            "max": int(notes[prefix + "max-scale"]) if prefix + "max-scale" in notes else None,
            "last_scale_time": None,
            "conditions": _conditions(ksvc),
            "metric": {
                "name": notes.get(prefix + "metric", "concurrency"),
                "target": notes.get(prefix + "target"),
            },
            "revision": revision,
            "ready_revision": status.get("latestReadyRevisionName"),
            "url": status.get("url"),
        }

    def _served_rows(self, api: KubeApi) -> list[dict[str, Any]]:
        rows = []
        managed = ",".join(
            f"{k}={v}" for k, v in {**km.MANAGED_LABELS, kss.MODE_LABEL: kss.SERVE}.items()
        )
        for dep in scan(api, "Deployment", managed):
            status = dep.get("status") or {}
            rows.append(
                {
                    "name": dep["metadata"]["labels"].get(km.NAME_LABEL, dep["metadata"]["name"]),
                    "backend": self.name,
                    "namespace": api.namespace,
                    "pods": status.get("replicas", 0),
                    "ready": status.get("readyReplicas", 0),
                    "detached": True,
                    "autoscaled": True,
                    "autoscaler": "hpa",
                }
            )
        for ksvc in scan(api, "KnativeService", managed):
            name = ksvc["metadata"]["labels"].get(km.NAME_LABEL, ksvc["metadata"]["name"])
            pods = [p for p in api.list("Pod", km.selector(name)) if _alive(p)]
            ready = sum(
                1
                for p in pods
                if any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in p["status"].get("conditions") or []
                )
            )
            rows.append(
                {
                    "name": name,
                    "backend": self.name,
                    "namespace": api.namespace,
                    "pods": len(pods),
                    "ready": ready,
                    "detached": True,
                    "autoscaled": True,
                    "autoscaler": "knative",
                }
            )
        return rows
