"""The Kubernetes backend's autoscaled deployments (``Compute.autoscale``): apply, look up,
scale status and removal of the objects ``kube_serving`` renders.

The cluster scales them (Knative, or a HorizontalPodAutoscaler); ktlite only makes the objects,
waits until a replica's server answers, reports the replicas that run, and keeps the current
launch in the ``NAME-launch`` Secret for replicas started later. Mixed into
:class:`~ktlite.backends.kubernetes.KubernetesBackend`, whose helpers it uses.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import httpx

from ktlite.backends import kube_launch
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_secrets as ksec
from ktlite.backends import kube_serving as kss
from ktlite.backends.base import Applied, PodEndpoint
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_diagnose import diagnose, progress
from ktlite.errors import DeployError, LaunchTimeout
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import DEFAULT_MASTER_PORT
from ktlite_wire.launch import Launch

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object

CAPABILITIES_TTL_S = 300.0  # a cluster that gets Knative or an adapter is seen within this
SETTLE_S = 15.0  # after the first replica answers, how long apply waits for the others started with it


def _pod_hash(obj: dict[str, Any]) -> str | None:
    value: str | None = ((obj.get("metadata") or {}).get("annotations") or {}).get(km.HASH_ANNOTATION)
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
    return status.get("phase") == "Running" and bool(status.get("podIP")) \
        and not pod["metadata"].get("deletionTimestamp")


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: c.get(k, "") for k in ("type", "status", "reason", "message")}
            for c in (obj.get("status") or {}).get("conditions") or []]


def _peek(api: KubeApi, kind: str, name: str) -> dict[str, Any] | None:
    """``api.get`` for the kinds only served deployments use: None also where this account may
    not read them (403: it cannot have made any) or the cluster does not serve the kind (404)."""
    try:
        return api.get(kind, name)
    except KubeApiError as e:
        if e.status in (403, 404):
            return None
        raise


def _scan(api: KubeApi, kind: str, selector: str) -> list[dict[str, Any]]:
    """``api.list`` of such a kind: empty where it may not be read or is not served."""
    try:
        return api.list(kind, selector)
    except KubeApiError as e:
        if e.status in (403, 404):
            return []
        raise


def _served(obj: dict[str, Any] | None, name: str) -> bool:
    """``obj`` is a served deployment's object ktlite made for ``name``."""
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(km.NAME_LABEL) == name and labels.get(kss.MODE_LABEL) == kss.SERVE


class ServedDeployments(_Base):
    """Autoscaled deployments on Kubernetes (mixed into the backend)."""

    # per API connection (an httpx.Client): what its cluster has, and when that was asked
    _capabilities_cache: weakref.WeakKeyDictionary[Any, tuple[float, kss.Capabilities]] = \
        weakref.WeakKeyDictionary()
    _noted: set[tuple[str, str]] = set()

    @property
    def _served_names(self) -> set[str]:
        """Names this backend object found served (lookup asks for their kind first)."""
        names: set[str] = self.__dict__.setdefault("_served_names_set", set())
        return names

    # ---- what the cluster has -----------------------------------------------------------------

    def capabilities(self, api: KubeApi | None = None) -> kss.Capabilities:
        """Knative Serving's CRD and a custom-metrics adapter: asked once per cluster and
        backend (again after ``CAPABILITIES_TTL_S``)."""
        key = self._connect()[0]
        cached = self._capabilities_cache.get(key)
        if cached is not None and self._clock() - cached[0] < CAPABILITIES_TTL_S:
            return cached[1]
        api = api or self._api()
        knative = api.cluster_get(kss.CRD_PATH, "read Knative Serving's CustomResourceDefinition") is not None
        adapter = api.cluster_get(kss.ADAPTER_PATH, "read the custom metrics APIService")
        available = any(c.get("type") == "Available" and c.get("status") == "True"
                        for c in ((adapter or {}).get("status") or {}).get("conditions") or [])
        caps = kss.Capabilities(knative=knative, custom_metrics=available)
        self._capabilities_cache[key] = (self._clock(), caps)
        return caps

    def _known_capabilities(self) -> kss.Capabilities:
        """For a plan (which reads no cluster): what this backend has seen, else no Knative and
        no adapter (the HPA form on CPU)."""
        if self._http is None or self._info is None:
            return kss.Capabilities()
        cached = self._capabilities_cache.get(self._http)
        return cached[1] if cached is not None else kss.Capabilities()

    def autoscaler(self, spec: DeploymentSpec) -> str:
        """``"knative"`` where Knative Serving is installed, else ``"hpa"``."""
        return self.capabilities().autoscaler

    def _note(self, name: str, text: str) -> None:
        if (name, text) not in self._noted:
            self._noted.add((name, text))
            self._say(f"{name}: {text}")

    # ---- apply --------------------------------------------------------------------------------

    def _apply_served(self, spec: DeploymentSpec, token: str) -> Applied:
        api = self._api()
        self._announce(api)
        caps = self.capabilities(api)
        for text in kss.notes(spec, caps):
            self._note(spec.name, text)
        resolved = km.resolve_secrets(spec, api.namespace)
        objects = self._render_served(spec, api.namespace, token, resolved, caps)
        users = ksec.check_user_secrets(api, spec.name, objects, resolved)
        name = spec.name
        workload = objects[-1] if caps.knative else next(o for o in objects if o["kind"] == "Deployment")
        want = _pod_hash(kss.template_of(workload)) or ""
        first = self._served_object(api, name) is None and api.get("StatefulSet", name) is None
        before = {p["metadata"]["uid"] for p in api.list("Pod", km.selector(name))}
        created: list[tuple[str, str]] = []
        try:
            self._drop_statefulsets(api, name)  # it was a distributed deployment before
            token_changed = ksec.apply_token_secret(api, objects[0], token, created)
            self._ensure(api, objects[1], created)  # the launch Secret: made empty, never reset here
            for obj, current in users:
                ksec.apply_user_secret(api, obj, current, created)
            for claim in (o for o in objects if o["kind"] == "PersistentVolumeClaim"):
                self._ensure(api, claim, created)
            if caps.knative:
                self._drop_hpa_form(api, name)
                self._apply_workload(api, "KnativeService", workload, created)
            else:
                self._drop_knative(api, name)
                self._apply_service(api, objects[-3], created)
                self._apply_workload(api, "Deployment", workload, created)
                self._apply_hpa(api, objects[-1], created)
            if token_changed and not first:  # replicas read the token at start: restart them
                for pod in api.list("Pod", km.selector(name)):
                    api.delete("Pod", pod["metadata"]["name"])
            ksec.drop_stale_secrets(api, name, {o["metadata"]["name"] for o, _ in users})
            pods = self._wait_served(api, spec, want, caps)
        except BaseException as e:
            raise self._failed(api, name, e, created if first else None, served=True) from e
        return self._applied_served(name, pods, token, want, kss.autoscale_of(workload), before)

    def _render_served(self, spec: DeploymentSpec, namespace: str, token: str | None,
                       secrets: list[Any] | None, caps: kss.Capabilities) -> list[dict[str, Any]]:
        spec = self._with_settings(spec)
        return kss.render(spec, namespace, image=self._image(spec), install=self._install(), caps=caps,
                          token=token, secrets=secrets)

    def _served_object(self, api: KubeApi, name: str) -> dict[str, Any] | None:
        """The Deployment or Knative Service of the served deployment ``name``, or None."""
        for kind in ("Deployment", "KnativeService"):
            obj = _peek(api, kind, name)
            if _served(obj, name):
                return obj
        return None

    def _apply_service(self, api: KubeApi, svc: dict[str, Any], created: list[tuple[str, str]]) -> None:
        current = api.get("Service", svc["metadata"]["name"])
        if current is not None and current["spec"].get("clusterIP") == "None":
            api.delete("Service", svc["metadata"]["name"])  # a distributed deployment's headless one
            current = None
        if current is None:
            self._ensure(api, svc, created)
        elif current["spec"].get("selector") != svc["spec"]["selector"]:
            api.patch("Service", svc["metadata"]["name"], {"spec": {"selector": svc["spec"]["selector"],
                                                                    "ports": svc["spec"]["ports"]}})

    def _apply_workload(self, api: KubeApi, kind: str, obj: dict[str, Any],
                        created: list[tuple[str, str]]) -> None:
        """Create, or update when its pod template changed (the controller rolls the replicas;
        a Deployment keeps the replica count its autoscaler set)."""
        name = obj["metadata"]["name"]
        current = api.get(kind, name)
        if current is None:
            api.create(obj)
            created.append((kind, name))
            return
        if _pod_hash(kss.template_of(current)) == _pod_hash(kss.template_of(obj)):
            if kss.autoscale_of(current) != kss.autoscale_of(obj):  # new bounds: the pods stay
                api.patch(kind, name, {"metadata": {"annotations": {
                    kss.AUTOSCALE_ANNOTATION: obj["metadata"]["annotations"][kss.AUTOSCALE_ANNOTATION]}}})
            return
        if kind == "Deployment":
            obj = {**obj, "spec": {**obj["spec"], "replicas": current["spec"].get("replicas", 1)}}
        try:
            api.replace(obj, current["metadata"]["resourceVersion"])
        except KubeApiError as e:
            if e.status != 422:  # an immutable field (its selector) differs: make it again
                raise
            api.delete(kind, name, propagation="Foreground")
            self._wait_gone(api, kind, name, 60.0)
            api.create(obj)

    def _apply_hpa(self, api: KubeApi, obj: dict[str, Any], created: list[tuple[str, str]]) -> None:
        current = api.get("HorizontalPodAutoscaler", obj["metadata"]["name"])
        if current is None:
            self._ensure(api, obj, created)
            return
        digest = ((current["metadata"].get("annotations") or {}).get(kss.SPEC_ANNOTATION))
        if digest != obj["metadata"]["annotations"][kss.SPEC_ANNOTATION]:
            api.replace(obj, current["metadata"]["resourceVersion"])

    def _drop_statefulsets(self, api: KubeApi, name: str) -> None:
        """Remove a distributed deployment of the same name (its StatefulSets and policy)."""
        if api.list("StatefulSet", km.selector(name)):
            self._remove_stale_parts(api, name, set())
            self._drop_policy(api, name, only_if_there=True)

    def _drop_hpa_form(self, api: KubeApi, name: str) -> None:
        for kind in ("HorizontalPodAutoscaler", "Deployment"):
            if _served(_peek(api, kind, name), name):
                api.delete(kind, name)
        svc = api.get("Service", name)
        if _served(svc, name):
            api.delete("Service", name)

    def _drop_knative(self, api: KubeApi, name: str) -> None:
        if _served(_peek(api, "KnativeService", name), name):
            api.delete("KnativeService", name)

    def drop_served(self, api: KubeApi, name: str) -> None:
        """Before a distributed deployment of ``name``: remove a served one of that name."""
        obj = self._served_object(api, name)
        if obj is None:
            return
        self._drop_hpa_form(api, name)
        self._drop_knative(api, name)
        api.delete("Secret", kss.launch_secret_name(name))
        self._wait_pods_gone(api, name, 60.0)

    def _wait_served(self, api: KubeApi, spec: DeploymentSpec, want: str,
                     caps: kss.Capabilities) -> list[dict[str, Any]]:
        """The replicas of the current template whose server answers /health (not readiness:
        that comes with the client's first push): at least one, and those started with it
        (waited for ``SETTLE_S`` more); fails early with the reason a replica cannot start and
        after ``launch_timeout`` with the last reason seen. A Knative Service that keeps no
        replica (``initial_scale=0``) counts once Knative reports it Ready."""
        timeout = spec.pod.calls.launch_timeout
        start = self._clock()
        deadline, settle_until = start + timeout, None
        last_line, last_reason = "", "no replica was created yet"
        answering: set[str] = set()
        while True:
            pods = [p for p in api.list("Pod", km.selector(spec.name))
                    if _pod_hash(p) == want and not p["metadata"].get("deletionTimestamp")]
            line = ("replicas " + progress(pods, len(pods)).removeprefix("pods ")) if pods \
                else "no replica created yet"
            if line != last_line:
                self._say(f"{spec.name}: {line}")
                last_line = line
            serving = [p for p in pods if self._serving(api, p, answering)]
            now = self._clock()
            if serving:
                settle_until = settle_until if settle_until is not None else now + SETTLE_S
                if len(serving) == len(pods) or now >= min(settle_until, deadline):
                    return serving
            elif not pods and caps.knative and self._knative_ready(api, spec.name):
                return []
            for pod in pods:
                problem = diagnose(pod, scaling_up=lambda p: self._scaling_up(api, p),
                                   claims=lambda p: self._claims_problem(api, p))
                if problem is None:
                    continue
                if problem.fatal and not serving:
                    raise kp.deploy_error(problem, self._explain(api, spec, problem))
                last_reason = problem.message
            if now > deadline:
                what = "Knative Service" if caps.knative else "Deployment"
                raise LaunchTimeout(
                    f"served deployment {spec.name!r}: no replica's server answered /health within "
                    f"launch_timeout={timeout:g}s ({line}; last reason: {last_reason}). Raise launch_timeout, "
                    f"or look at `kubectl -n {api.namespace} describe pods -l {km.selector(spec.name)}` "
                    f"and `kubectl -n {api.namespace} describe {what.lower().replace(' ', '')} {spec.name}`")
            self._sleep(min(1.0, 0.1 + (now - start) / 20))

    def wake(self, name: str, timeout: float) -> bool:
        """Knative at zero replicas: ktlite calls replicas directly, which never reaches
        Knative's activator, so the first call would wait for ever. One ``GET /health``
        through the revision's Service (the API server's service proxy; Knative's routing
        headers, as its ingress sets them) reaches the activator, which starts a replica and
        holds the request until it answers. True when that answered."""
        api = self._api()
        status = (api.get("KnativeService", name) or {}).get("status") or {}
        revision = status.get("latestReadyRevisionName") or status.get("latestCreatedRevisionName")
        if not revision:
            return False
        namespace = self.namespace
        http, _ = self._connect()
        try:
            resp = http.get(f"/api/v1/namespaces/{namespace}/services/{revision}:http/proxy/health",
                            headers={"Knative-Serving-Revision": revision, "Knative-Serving-Namespace": namespace},
                            timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _knative_ready(self, api: KubeApi, name: str) -> bool:
        ksvc = api.get("KnativeService", name) or {}
        return any(c["type"] == "Ready" and c["status"] == "True" for c in _conditions(ksvc))

    def _wait_pods_gone(self, api: KubeApi, name: str, timeout: float) -> None:
        deadline = self._clock() + timeout
        while pods := api.list("Pod", km.selector(name)):
            if self._clock() > deadline:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                raise DeployError(f"the replicas of served deployment {name!r} ({names}) were still "
                                  f"terminating after {timeout:g}s; check `kubectl -n {api.namespace} get pods "
                                  f"-l {km.selector(name)}`")
            self._sleep(0.5)

    def _applied_served(self, name: str, pods: list[dict[str, Any]], token: str, spec_hash: str,
                        autoscale: dict[str, Any] | None, before: set[str] | None = None) -> Applied:
        """Replicas by name; ordinal = place in that order (replicas have no ordinals of their own)."""
        api = self._api()
        http, info = self._connect()
        endpoints, restarted = [], []
        for i, pod in enumerate(sorted(pods, key=lambda p: p["metadata"]["name"])):
            ip, pod_name = pod["status"].get("podIP", ""), pod["metadata"]["name"]
            peer = kp.url(ip, km.SERVER_PORT)
            port = call_port(pod)
            endpoints.append(PodEndpoint(name=pod_name, ordinal=i, ip=ip, peer_url=peer,
                                         url=kp.url(ip, port) if info.in_cluster else api.proxy_url(pod_name, port),
                                         incarnation=kp.incarnation(pod)))
            if before is not None and pod["metadata"]["uid"] not in before:
                restarted.append(i)
        return Applied(name=name, backend=self.name, endpoints=endpoints, token=token,
                       master_port=DEFAULT_MASTER_PORT, restarted=restarted,
                       http=None if info.in_cluster else http, spec_hash=spec_hash, autoscale=autoscale)

    # ---- lookup, launch, status ------------------------------------------------------------

    def _lookup_served(self, api: KubeApi, name: str) -> Applied | None:
        obj = self._served_object(api, name)
        secret = api.get("Secret", km.token_secret_name(name))
        if obj is None or secret is None:
            return None
        token = ksec.decode_token(secret)
        if token is None:
            return None
        want = _pod_hash(kss.template_of(obj)) or ""
        pods = [p for p in api.list("Pod", km.selector(name)) if _pod_hash(p) == want and _alive(p)]
        self._served_names.add(name)
        return self._applied_served(name, pods, token, want, kss.autoscale_of(obj))

    def write_launch(self, name: str, launch: Launch) -> Launch:
        """Keep ``launch`` in the ``NAME-launch`` Secret as its next generation (kube_launch)."""
        return kube_launch.write(self._api(), name, launch)

    def scaling_status(self, name: str) -> dict[str, Any] | None:
        """What the cluster's autoscaler says: replicas now and wanted, its bounds, when it last
        scaled, its conditions (e.g. FailedGetResourceMetric without metrics-server) and its
        metric; None for a deployment that is not served."""
        api = self._api()
        hpa = _peek(api, "HorizontalPodAutoscaler", name)
        if _served(hpa, name):
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
                "metric": _describe_metric(spec, status, _peek(api, "Deployment", name)),
            }
        ksvc = _peek(api, "KnativeService", name)
        if not _served(ksvc, name):
            return None
        assert ksvc is not None
        status = ksvc.get("status") or {}
        notes = kss.template_of(ksvc)["metadata"].get("annotations") or {}
        prefix = "autoscaling.knative.dev/"
        revision = status.get("latestCreatedRevisionName")
        scaler = (_peek(api, "PodAutoscaler", revision) or {}) if revision else {}
        pods = [p for p in api.list("Pod", km.selector(name)) if _alive(p)]
        scaler_status = scaler.get("status") or {}
        return {"autoscaler": "knative", "current": scaler_status.get("actualScale", len(pods)),
                "desired": scaler_status.get("desiredScale"), "min": int(notes.get(prefix + "min-scale", 0)),
                "max": int(notes[prefix + "max-scale"]) if prefix + "max-scale" in notes else None,
                "last_scale_time": None, "conditions": _conditions(ksvc),
                "metric": {"name": notes.get(prefix + "metric", "concurrency"),
                           "target": notes.get(prefix + "target")},
                "revision": revision, "ready_revision": status.get("latestReadyRevisionName"),
                "url": status.get("url")}

    # ---- teardown / list --------------------------------------------------------------------

    def _teardown_served(self, api: KubeApi, name: str) -> bool:
        """Delete a served deployment's own objects (the shared ones go with the rest)."""
        found = False
        for kind in ("HorizontalPodAutoscaler", "Deployment", "KnativeService"):
            for obj in _scan(api, kind, km.selector(name)):
                found |= api.delete(kind, obj["metadata"]["name"])
        found |= api.delete("Secret", kss.launch_secret_name(name))
        return found

    def _served_rows(self, api: KubeApi) -> list[dict[str, Any]]:
        rows = []
        managed = ",".join(f"{k}={v}" for k, v in {**km.MANAGED_LABELS, kss.MODE_LABEL: kss.SERVE}.items())
        for dep in _scan(api, "Deployment", managed):
            status = dep.get("status") or {}
            rows.append({"name": dep["metadata"]["labels"].get(km.NAME_LABEL, dep["metadata"]["name"]),
                         "backend": self.name, "namespace": api.namespace,
                         "pods": status.get("replicas", 0), "ready": status.get("readyReplicas", 0),
                         "detached": True, "autoscaled": True, "autoscaler": "hpa"})
        for ksvc in _scan(api, "KnativeService", managed):
            name = ksvc["metadata"]["labels"].get(km.NAME_LABEL, ksvc["metadata"]["name"])
            pods = [p for p in api.list("Pod", km.selector(name)) if _alive(p)]
            ready = sum(1 for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                               for c in p["status"].get("conditions") or []))
            rows.append({"name": name, "backend": self.name, "namespace": api.namespace, "pods": len(pods),
                         "ready": ready, "detached": True, "autoscaled": True, "autoscaler": "knative"})
        return rows


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
        return {"name": metric["pods"]["metric"]["name"], "target": metric["pods"]["target"].get("averageValue"),
                "current": value}
    return {"name": metric.get("type"), "target": None, "current": None}
