"""The Kubernetes backend: a deployment is a StatefulSet of ktlite server pods.

``plan`` renders the objects (``kube_manifests``); ``apply`` creates what is missing,
replaces only pods whose template changed (code lives in the pods' memory, so a code-only
redeploy touches no pod), and waits for readiness, failing early with the reason a pod
cannot start. Pods are reached through the API server's pod proxy from outside the
cluster and by pod IP inside it; ranks find each other by pod IP (no cluster DNS).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

import httpx

from ktlite.backends import kube_expiry as kexp
from ktlite.backends import kube_logs
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_secrets as ksec
from ktlite.backends import kube_serving as kss
from ktlite.backends.base import Applied, Backend, Plan, PodEndpoint
from ktlite.backends.kube_api import ClusterInfo, KubeApi, KubeApiError, load
from ktlite.backends.kube_readiness import PodReadiness
from ktlite.backends.kube_served import ServedDeployments
from ktlite.backends.kube_statefulsets import StatefulSets
from ktlite.backends.kube_teardown import Teardown
from ktlite.config import get as setting
from ktlite.errors import DeployError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.secrets import Resolved
from ktlite.specs.spec import DEFAULT_MASTER_PORT

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11


class KubernetesBackend(ServedDeployments, StatefulSets, Teardown, PodReadiness, Backend):
    name = "kubernetes"
    _clients: dict[tuple[str | None, str | None], tuple[httpx.Client, ClusterInfo]] = {}
    _announced: set[str] = set()
    _lock = threading.Lock()

    def __init__(
        self,
        http: httpx.Client | None = None,
        info: ClusterInfo | None = None,
        namespace: str | None = None,
        *,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``http`` and ``info`` default to the kubeconfig's cluster, loaded on first use;
        tests inject both (an ``httpx.Client`` over a fake transport)."""
        self._http = http
        self._info = info
        self._namespace = namespace
        self._out = out
        self._clock = clock
        self._sleep = sleep

    @classmethod
    def shared(cls, namespace: str | None = None, kubeconfig: str | None = None) -> Self:
        backend = cls(namespace=namespace)
        backend._kubeconfig = kubeconfig
        return backend

    _kubeconfig: str | None = None  # Compute(kubeconfig_path=...), else ktlite config's

    def where(self) -> str:
        return f"{self.name} (namespace {self.namespace})"

    def store_handoff(self) -> dict[str, Any] | None:
        from ktlite.backends.kube_store import handoff  # the store's objects load when asked for

        return handoff(self)

    def _connect(self) -> tuple[httpx.Client, ClusterInfo]:
        if self._http is None or self._info is None:
            key = (self._kubeconfig or setting("kubeconfig"), setting("context"))
            with self._lock:
                if key not in self._clients:
                    self._clients[key] = load(*key)
            self._http, self._info = self._clients[key]
        return self._http, self._info

    @property
    def namespace(self) -> str:
        """The Compute's namespace, else ``ktlite config``'s, else the kubeconfig context's
        (resolved once per backend object)."""
        if not self._namespace:
            self._namespace = setting("namespace") or self._connect()[1].namespace
        return self._namespace

    def _api(self) -> KubeApi:
        return KubeApi(self._connect()[0], self.namespace)

    def _say(self, text: str) -> None:
        print(f"ktlite: {text}", file=self._out or sys.stderr, flush=True)

    # ---- plan -------------------------------------------------------------------------

    @staticmethod
    def _with_settings(spec: DeploymentSpec) -> DeploymentSpec:
        """``spec`` with ``ktlite config``'s image pull policy where the Compute names none."""
        kube = spec.pod.kubernetes
        if kube.image_pull_policy is None and setting("image_pull_policy"):
            from dataclasses import replace

            kube = replace(kube, image_pull_policy=setting("image_pull_policy"))
            spec = replace(spec, pod=replace(spec.pod, kubernetes=kube))
        return spec

    @staticmethod
    def _image(spec: DeploymentSpec) -> str:
        return spec.pod.image.image_id if spec.pod.image is not None else km.default_image()

    @staticmethod
    def _install() -> str:
        return km.install_spec()

    def _render(
        self,
        spec: DeploymentSpec,
        namespace: str,
        token: str | None,
        secrets: list[Resolved] | None = None,
    ) -> list[dict[str, Any]]:
        return km.render(
            self._with_settings(spec),
            namespace,
            image=self._image(spec),
            install=km.install_spec(),
            token=token,
            secrets=secrets,
        )

    def plan(self, spec: DeploymentSpec) -> Plan:
        """The objects deploying would apply; reads no cluster (the namespace comes from
        the Compute, ``ktlite config``, or "default"). A served deployment's plan is the form
        this backend has seen the cluster allow, else the HPA form without a metrics adapter;
        what that form changes is said in comment lines."""
        namespace = self._namespace or setting("namespace") or "default"
        if spec.autoscale is not None:
            caps = self._known_capabilities()
            return Plan(
                backend=self.name,
                name=spec.name,
                commands=[f"# {text}" for text in kss.notes(spec, caps)],
                manifests=self._render_served(spec, namespace, None, None, caps),
            )
        return Plan(
            backend=self.name, name=spec.name, manifests=self._render(spec, namespace, None)
        )

    # ---- apply --------------------------------------------------------------------------

    def _announce(self, api: KubeApi) -> None:
        info = self._connect()[1]
        if info.host not in self._announced:
            self._announced.add(info.host)
            self._say(
                f"backend kubernetes, context {info.context!r}, namespace {api.namespace!r} "
                f"({info.host})"
            )

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        if spec.autoscale is not None:
            return self._apply_served(spec, token)
        api = self._api()
        self._announce(api)
        resolved = km.resolve_secrets(spec, api.namespace)  # a preset that finds nothing fails here
        objects = self._render(spec, api.namespace, token, resolved)
        secret, service = objects[:2]
        users = ksec.check_user_secrets(
            api, spec.name, objects, resolved
        )  # before anything is made
        claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        statefulsets = [o for o in objects if o["kind"] == "StatefulSet"]
        first = api.get("StatefulSet", spec.name) is None
        created: list[tuple[str, str]] = []  # (kind, name) of what this apply made
        try:
            if first:  # it may have been a served deployment: its replicas go first
                self.drop_served(api, spec.name)
            token_changed = ksec.apply_token_secret(api, secret, token, created)
            self._ensure(api, service, created)
            for obj, current in users:
                ksec.apply_user_secret(api, obj, current, created)
            for claim in claims:
                self._ensure(api, claim, created)
            for policy in policies:  # before the pods: no moment where their ports are open
                self._apply_policy(api, policy, created)
            kexp.apply_access(api, objects, spec.name, created)  # inactivity_ttl's
            self._remove_stale_parts(api, spec.name, {s["metadata"]["name"] for s in statefulsets})
            restarted: list[int] = []
            for sts in statefulsets:
                new = api.get("StatefulSet", sts["metadata"]["name"]) is None
                restarted += self._apply_statefulset(api, sts, roll_all=token_changed)
                if first and new:
                    created.append(("StatefulSet", sts["metadata"]["name"]))
            ksec.drop_stale_secrets(api, spec.name, {o["metadata"]["name"] for o, _ in users})
            pods = self.wait_ready(api, spec, kp.ordinal_hashes(statefulsets))
        except BaseException as e:
            raise self._failed(api, spec.name, e, created if first else None) from e
        return self._applied(spec.name, pods, token, km.master_port(spec), sorted(set(restarted)))

    def _failed(
        self,
        api: KubeApi,
        name: str,
        error: BaseException,
        created: list[tuple[str, str]] | None,
        served: bool = False,
    ) -> BaseException:
        """A deploy that failed: a first deploy's objects are removed again (pods that did
        start would hold their CPUs for nothing) unless the keep_failed setting says keep them;
        otherwise the error says what is left and how to remove it."""
        if not isinstance(error, Exception):  # Ctrl-C: roll back too, but re-raise as it is
            if created:
                with contextlib.suppress(Exception):
                    self._remove(api, name, created)
            return error
        keep = (setting("keep_failed") or "").lower() == "true"
        if created and not keep:
            try:
                self._remove(api, name, created)
                note = "removed what this deploy had created: " + ", ".join(
                    f"{kind} {obj}" for kind, obj in created
                )
            except Exception as e:  # noqa: BLE001
                note = (
                    f"could not remove what this deploy created ({e}); remove it with "
                    f"`ktlite teardown {name} -n {api.namespace}`"
                )
        elif created:
            note = (
                f"kept (keep_failed=true): {', '.join(f'{kind} {obj}' for kind, obj in created)}"
                f"; `ktlite teardown {name} -n {api.namespace}` removes them"
            )
        else:
            parts = (
                "its Deployment and HorizontalPodAutoscaler (or Knative Service), replicas"
                if served
                else f"StatefulSet {name} and its pods"
            )
            note = (
                f"the deployment's objects ({parts}, Service, Secrets, "
                f"volumes) are still there; `ktlite teardown {name} -n {api.namespace}` removes "
                "them"
            )
        if isinstance(error, DeployError) and error.args and isinstance(error.args[0], str):
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])  # its own type kept
            return error
        if sys.version_info >= (3, 11):  # notes are Python 3.11's; before, the error goes as it is
            error.add_note(note)
        return error

    def _ensure(self, api: KubeApi, obj: dict[str, Any], created: list[tuple[str, str]]) -> None:
        if api.get(obj["kind"], obj["metadata"]["name"]) is None:
            try:
                api.create(obj)
                created.append((obj["kind"], obj["metadata"]["name"]))
            except KubeApiError as e:
                if e.status != 409:  # created concurrently: fine
                    raise

    def _apply_policy(
        self, api: KubeApi, policy: dict[str, Any], created: list[tuple[str, str]]
    ) -> None:
        """Create the deployment's NetworkPolicy, or replace one that says otherwise (made by
        an older ktlite, or for the other serving form); a redeploy that changes nothing
        writes nothing. Without the right to manage policies the deploy fails, saying so."""
        name = policy["metadata"]["name"]
        try:
            current = api.get("NetworkPolicy", name)
            if current is None:
                self._ensure(api, policy, created)
            elif current.get("spec") != policy["spec"]:
                api.replace(policy, current["metadata"]["resourceVersion"])
        except KubeApiError as e:
            if e.status != 403:
                raise
            raise DeployError(
                f"cannot manage NetworkPolicy {name!r} in namespace {api.namespace!r} ({e}); "
                "every deployment gets one, so that only its own pods reach its rendezvous "
                "and collective ports: give your Role the verbs get, create, update, delete on "
                "networkpolicies.networking.k8s.io (docs/kubernetes.md, 'Permissions')"
            ) from e

    def _applied(
        self,
        name: str,
        pods: list[dict[str, Any]],
        token: str,
        master_port: int,
        restarted: list[int],
    ) -> Applied:
        api = self._api()
        http, info = self._connect()
        endpoints = []
        for pod in sorted(pods, key=kp.ordinal):
            ip = pod["status"].get("podIP", "")
            pod_name = pod["metadata"]["name"]
            peer, url = kp.urls(pod, km.SERVER_PORT, None if info.in_cluster else api.proxy_url)
            endpoints.append(
                PodEndpoint(
                    name=pod_name,
                    ordinal=kp.ordinal(pod),
                    ip=ip,
                    peer_url=peer,
                    url=url,
                    incarnation=kp.incarnation(pod),
                )
            )
        return Applied(
            name=name,
            backend=self.name,
            endpoints=endpoints,
            token=token,
            master_port=master_port,
            restarted=restarted,
            http=None if info.in_cluster else http,
            spec_hash=(kp.pod_hash(pods[0]) or "") if pods else "",
        )

    # ---- lookup / teardown / list / logs ------------------------------------------------------

    def lookup(self, name: str) -> Applied | None:
        api = self._api()
        # a serving client asks several times a second: its kind first
        if name in self._served_names:
            found = self._lookup_served(api, name)
            if found is not None:
                return found
            self._served_names.discard(name)
        statefulsets = api.list("StatefulSet", km.selector(name))
        secret = api.get("Secret", km.token_secret_name(name))
        if not any(s["metadata"]["name"] == name for s in statefulsets):
            return self._lookup_served(api, name)
        if secret is None:
            return None
        token = ksec.decode_token(secret)
        if token is None:
            return None
        want = kp.ordinal_hashes(statefulsets)
        pods = [
            p
            for p in api.list("Pod", km.selector(name))
            if kp.pod_hash(p) == want.get(kp.ordinal(p))
            and p.get("status", {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")
        ]
        head = next(s for s in statefulsets if s["metadata"]["name"] == name)
        ports = [
            p.get("containerPort")
            for p in head["spec"]["template"]["spec"]["containers"][0]["ports"]
            if p.get("name") == "master"
        ]
        return self._applied(name, pods, token, ports[0] if ports else DEFAULT_MASTER_PORT, [])

    def list(self) -> list[dict[str, Any]]:
        api = self._api()
        rows: dict[str, dict[str, Any]] = {}  # one row per deployment, over its StatefulSets
        managed = ",".join(f"{k}={v}" for k, v in km.MANAGED_LABELS.items())
        for sts in api.list("StatefulSet", managed):
            name = (sts["metadata"].get("labels") or {}).get(km.NAME_LABEL, sts["metadata"]["name"])
            row = rows.setdefault(
                name,
                {
                    "name": name,
                    "backend": self.name,
                    "namespace": api.namespace,
                    "pods": 0,
                    "ready": 0,
                    "detached": True,
                    "autoscaled": False,
                },
            )
            if sts["metadata"]["name"] == name:  # idle_s, ttl_s (inactivity_ttl)
                row.update(kexp.idleness(api, self._connect()[0], sts, km.SERVER_PORT))
            row["pods"] += sts["spec"].get("replicas", 0)
            row["ready"] += (sts.get("status") or {}).get("readyReplicas", 0)
        return [*rows.values(), *self._served_rows(api)]

    def logs(
        self, name: str, ordinal: int | None = None, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        yield from kube_logs.pod_logs(self._api(), name, ordinal, follow, tail)
