"""The Kubernetes backend's autoscaled deployments (``Compute.autoscale``): apply and removal
of the objects ``kube_serving`` renders.

The cluster scales them (Knative, or a HorizontalPodAutoscaler); ktlite only makes the objects,
waits until a replica's server answers, and keeps the current launch in the ``NAME-launch``
Secret for replicas started later. What the cluster reports of them (look up, replicas,
scaling status, list rows) is :mod:`~ktlite.backends.kube_served_status`'s. Mixed into
:class:`~ktlite.backends.kubernetes.KubernetesBackend`, whose helpers it uses.
"""

from __future__ import annotations

import weakref
from typing import Any

import httpx

from ktlite.backends import kube_launch
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_secrets as ksec
from ktlite.backends import kube_serving as kss
from ktlite.backends.base import Applied
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_diagnose import diagnose, progress
from ktlite.backends.kube_served_status import (
    ServedStatus,
    is_served,
    peek,
    pod_hash,
    scan,
)
from ktlite.errors import DeployError, LaunchTimeout
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.launch import Launch

CAPABILITIES_TTL_S = 300.0  # a cluster that gets Knative or an adapter is seen within this
# after the first replica answers, how long apply waits for the others started with it
SETTLE_S = 15.0


class ServedDeployments(ServedStatus):
    """Autoscaled deployments on Kubernetes (mixed into the backend)."""

    # per API connection (an httpx.Client): what its cluster has, and when that was asked
    _capabilities_cache: weakref.WeakKeyDictionary[Any, tuple[float, kss.Capabilities]] = (
        weakref.WeakKeyDictionary()
    )
    _noted: set[tuple[str, str]] = set()

    # ---- what the cluster has -----------------------------------------------------------------

    def capabilities(self, api: KubeApi | None = None) -> kss.Capabilities:
        """Knative Serving's CRD and a custom-metrics adapter: asked once per cluster and
        backend (again after ``CAPABILITIES_TTL_S``)."""
        key = self._connect()[0]
        cached = self._capabilities_cache.get(key)
        if cached is not None and self._clock() - cached[0] < CAPABILITIES_TTL_S:
            return cached[1]
        api = api or self._api()
        knative = (
            api.cluster_get(kss.CRD_PATH, "read Knative Serving's CustomResourceDefinition")
            is not None
        )
        adapter = api.cluster_get(kss.ADAPTER_PATH, "read the custom metrics APIService")
        available = any(
            c.get("type") == "Available" and c.get("status") == "True"
            for c in ((adapter or {}).get("status") or {}).get("conditions") or []
        )
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
        workload = (
            objects[-1] if caps.knative else next(o for o in objects if o["kind"] == "Deployment")
        )
        want = pod_hash(kss.template_of(workload)) or ""
        first = self._served_object(api, name) is None and api.get("StatefulSet", name) is None
        before = {p["metadata"]["uid"] for p in api.list("Pod", km.selector(name))}
        created: list[tuple[str, str]] = []
        try:
            self._drop_statefulsets(api, name)  # it was a distributed deployment before
            token_changed = ksec.apply_token_secret(api, objects[0], token, created)
            # the launch Secret: made empty, never reset here
            self._ensure(api, objects[1], created)
            for obj, current in users:
                ksec.apply_user_secret(api, obj, current, created)
            for claim in (o for o in objects if o["kind"] == "PersistentVolumeClaim"):
                self._ensure(api, claim, created)
            for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):  # before pods
                self._apply_policy(api, policy, created)
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

    def _render_served(
        self,
        spec: DeploymentSpec,
        namespace: str,
        token: str | None,
        secrets: list[Any] | None,
        caps: kss.Capabilities,
    ) -> list[dict[str, Any]]:
        spec = self._with_settings(spec)
        return kss.render(
            spec,
            namespace,
            image=self._image(spec),
            install=self._install(),
            caps=caps,
            token=token,
            secrets=secrets,
        )

    def _apply_service(
        self, api: KubeApi, svc: dict[str, Any], created: list[tuple[str, str]]
    ) -> None:
        current = api.get("Service", svc["metadata"]["name"])
        if current is not None and current["spec"].get("clusterIP") == "None":
            # a distributed deployment's headless one
            api.delete("Service", svc["metadata"]["name"])
            current = None
        if current is None:
            self._ensure(api, svc, created)
        elif current["spec"].get("selector") != svc["spec"]["selector"]:
            api.patch(
                "Service",
                svc["metadata"]["name"],
                {"spec": {"selector": svc["spec"]["selector"], "ports": svc["spec"]["ports"]}},
            )

    def _apply_workload(
        self, api: KubeApi, kind: str, obj: dict[str, Any], created: list[tuple[str, str]]
    ) -> None:
        """Create, or update when its pod template changed (the controller rolls the replicas;
        a Deployment keeps the replica count its autoscaler set)."""
        name = obj["metadata"]["name"]
        current = api.get(kind, name)
        if current is None:
            api.create(obj)
            created.append((kind, name))
            return
        if pod_hash(kss.template_of(current)) == pod_hash(kss.template_of(obj)):
            if kss.autoscale_of(current) != kss.autoscale_of(obj):  # new bounds: the pods stay
                api.patch(
                    kind,
                    name,
                    {
                        "metadata": {
                            "annotations": {
                                kss.AUTOSCALE_ANNOTATION: obj["metadata"]["annotations"][
                                    kss.AUTOSCALE_ANNOTATION
                                ]
                            }
                        }
                    },
                )
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
        digest = (current["metadata"].get("annotations") or {}).get(kss.SPEC_ANNOTATION)
        if digest != obj["metadata"]["annotations"][kss.SPEC_ANNOTATION]:
            api.replace(obj, current["metadata"]["resourceVersion"])

    def _drop_statefulsets(self, api: KubeApi, name: str) -> None:
        """Remove a distributed deployment of the same name (its StatefulSets; its policy is
        replaced by the served form's)."""
        if api.list("StatefulSet", km.selector(name)):
            self._remove_stale_parts(api, name, set())

    def _drop_hpa_form(self, api: KubeApi, name: str) -> None:
        for kind in ("HorizontalPodAutoscaler", "Deployment"):
            if is_served(peek(api, kind, name), name):
                api.delete(kind, name)
        svc = api.get("Service", name)
        if is_served(svc, name):
            api.delete("Service", name)

    def _drop_knative(self, api: KubeApi, name: str) -> None:
        if is_served(peek(api, "KnativeService", name), name):
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

    def _wait_served(
        self, api: KubeApi, spec: DeploymentSpec, want: str, caps: kss.Capabilities
    ) -> list[dict[str, Any]]:
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
            pods = [
                p
                for p in api.list("Pod", km.selector(spec.name))
                if pod_hash(p) == want and not p["metadata"].get("deletionTimestamp")
            ]
            line = (
                ("replicas " + progress(pods, len(pods)).removeprefix("pods "))
                if pods
                else "no replica created yet"
            )
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
                problem = diagnose(
                    pod,
                    scaling_up=lambda p: self._scaling_up(api, p),
                    claims=lambda p: self._claims_problem(api, p),
                )
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
                    f"and `kubectl -n {api.namespace} describe {what.lower().replace(' ', '')} {spec.name}`"
                )
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
            resp = http.get(
                f"/api/v1/namespaces/{namespace}/services/{revision}:http/proxy/health",
                headers={
                    "Knative-Serving-Revision": revision,
                    "Knative-Serving-Namespace": namespace,
                },
                timeout=timeout,
            )
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _wait_pods_gone(self, api: KubeApi, name: str, timeout: float) -> None:
        deadline = self._clock() + timeout
        while pods := api.list("Pod", km.selector(name)):
            if self._clock() > deadline:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                raise DeployError(
                    f"the replicas of served deployment {name!r} ({names}) were still "
                    f"terminating after {timeout:g}s; check `kubectl -n {api.namespace} get pods "
                    f"-l {km.selector(name)}`"
                )
            self._sleep(0.5)

    # ---- launch ---------------------------------------------------------------------------

    def write_launch(self, name: str, launch: Launch) -> Launch:
        """Keep ``launch`` in the ``NAME-launch`` Secret as its next generation (kube_launch)."""
        return kube_launch.write(self._api(), name, launch)

    # ---- teardown -------------------------------------------------------------------------

    def _teardown_served(self, api: KubeApi, name: str) -> bool:
        """Delete a served deployment's own objects (the shared ones go with the rest)."""
        found = False
        for kind in ("HorizontalPodAutoscaler", "Deployment", "KnativeService"):
            for obj in scan(api, kind, km.selector(name)):
                found |= api.delete(kind, obj["metadata"]["name"])
        found |= api.delete("Secret", kss.launch_secret_name(name))
        return found
