"""The Kubernetes backend: a deployment is a StatefulSet of ktlite server pods.

``plan`` renders the objects (``kube_manifests``); ``apply`` creates what is missing,
replaces only pods whose template changed (code lives in the pods' memory, so a code-only
redeploy touches no pod), and waits for readiness, failing early with the reason a pod
cannot start. Pods are reached through the API server's pod proxy from outside the
cluster and by pod IP inside it; ranks find each other by pod IP (no cluster DNS).
"""

from __future__ import annotations

import base64
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import httpx

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_serving as kss
from ktlite.backends.base import Applied, Backend, Plan, PodEndpoint
from ktlite.backends.kube_api import ClusterInfo, KubeApi, KubeApiError, load
from ktlite.backends.kube_diagnose import PodProblem, diagnose, progress
from ktlite.backends.kube_served import ServedDeployments
from ktlite.config import get as setting
from ktlite.deployment_spec import DeploymentSpec
from ktlite.errors import (
    ConfigError,
    DeployError,
    ImagePullError,
    LaunchTimeout,
    PodTerminatedError,
    ResourceNotAvailableError,
    SecretNotFound,
    StartupError,
)
from ktlite.secrets import Resolved
from ktlite.spec import DEFAULT_MASTER_PORT
from ktlite.version import __version__

POLL_S = 1.0


def default_image() -> str:
    return setting("image") or f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def install_spec() -> str:
    return setting("install") or f"ktlite=={__version__}"


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def _ordinal(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["name"].rsplit("-", 1)[1])


def _first_ordinal(sts: dict[str, Any]) -> int:
    return int((sts["spec"].get("ordinals") or {}).get("start", 0))


def _match(sts: dict[str, Any]) -> str:
    """A label selector for the pods of ``sts``."""
    return ",".join(f"{k}={v}" for k, v in sts["spec"]["selector"]["matchLabels"].items())


def _ordinal_hashes(statefulsets: list[dict[str, Any]]) -> dict[int, str]:
    """ordinal → the pod hash its StatefulSet's template asks for."""
    want: dict[int, str] = {}
    for sts in statefulsets:
        start = _first_ordinal(sts)
        for ordinal in range(start, start + sts["spec"].get("replicas", 0)):
            want[ordinal] = _pod_hash(sts["spec"]["template"]) or ""
    return want


def _pod_hash(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata", {})
    value: str | None = (meta.get("annotations") or {}).get(km.HASH_ANNOTATION)
    return value


class KubernetesBackend(ServedDeployments, Backend):
    name = "kubernetes"
    _clients: dict[tuple[str | None, str | None], tuple[httpx.Client, ClusterInfo]] = {}
    _announced: set[str] = set()
    _lock = threading.Lock()

    def __init__(self, http: httpx.Client | None = None, info: ClusterInfo | None = None,
                 namespace: str | None = None, *, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """``http`` and ``info`` default to the kubeconfig's cluster, loaded on first use;
        tests inject both (an ``httpx.Client`` over a fake transport)."""
        self._http = http
        self._info = info
        self._namespace = namespace
        self._out = out
        self._clock = clock
        self._sleep = sleep

    @classmethod
    def shared(cls, namespace: str | None = None, kubeconfig: str | None = None) -> KubernetesBackend:
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
        return spec.pod.image.image_id if spec.pod.image is not None else default_image()

    @staticmethod
    def _install() -> str:
        return install_spec()

    def _render(self, spec: DeploymentSpec, namespace: str, token: str | None,
                secrets: list[Resolved] | None = None) -> list[dict[str, Any]]:
        return km.render(self._with_settings(spec), namespace, image=self._image(spec), install=install_spec(),
                         token=token, secrets=secrets)

    def plan(self, spec: DeploymentSpec) -> Plan:
        """The objects deploying would apply; reads no cluster (the namespace comes from
        the Compute, ``ktlite config``, or "default"). A served deployment's plan is the form
        this backend has seen the cluster allow, else the HPA form without a metrics adapter;
        what that form changes is said in comment lines."""
        namespace = self._namespace or setting("namespace") or "default"
        if spec.autoscale is not None:
            caps = self._known_capabilities()
            return Plan(backend=self.name, name=spec.name,
                        commands=[f"# {text}" for text in kss.notes(spec, caps)],
                        manifests=self._render_served(spec, namespace, None, None, caps))
        return Plan(backend=self.name, name=spec.name, manifests=self._render(spec, namespace, None))

    # ---- apply --------------------------------------------------------------------------

    def _announce(self, api: KubeApi) -> None:
        info = self._connect()[1]
        if info.host not in self._announced:
            self._announced.add(info.host)
            self._say(f"backend kubernetes, context {info.context!r}, namespace {api.namespace!r} "
                      f"({info.host})")

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        if spec.autoscale is not None:
            return self._apply_served(spec, token)
        api = self._api()
        self._announce(api)
        resolved = km.resolve_secrets(spec, api.namespace)  # a preset that finds nothing fails here
        objects = self._render(spec, api.namespace, token, resolved)
        secret, service = objects[:2]
        users = self._check_user_secrets(api, spec.name, objects, resolved)  # before anything is made
        claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        statefulsets = [o for o in objects if o["kind"] == "StatefulSet"]
        first = api.get("StatefulSet", spec.name) is None
        created: list[tuple[str, str]] = []  # (kind, name) of what this apply made
        try:
            if first:  # it may have been a served deployment: its replicas go first
                self.drop_served(api, spec.name)
            token_changed = self._apply_secret(api, secret, token, created)
            self._ensure(api, service, created)
            for obj, current in users:
                self._apply_user_secret(api, obj, current, created)
            for claim in claims:
                self._ensure(api, claim, created)
            for policy in policies:  # before the pods: no moment where their ports are open
                self._ensure(api, policy, created)
            if not policies and not first:  # a Monarch deployment redeployed as another kind
                self._drop_policy(api, spec.name, only_if_there=True)
            self._remove_stale_parts(api, spec.name, {s["metadata"]["name"] for s in statefulsets})
            restarted: list[int] = []
            for sts in statefulsets:
                new = api.get("StatefulSet", sts["metadata"]["name"]) is None
                restarted += self._apply_statefulset(api, sts, roll_all=token_changed)
                if first and new:
                    created.append(("StatefulSet", sts["metadata"]["name"]))
            self._drop_stale_secrets(api, spec.name, {o["metadata"]["name"] for o, _ in users})
            pods = self.wait_ready(api, spec, _ordinal_hashes(statefulsets))
        except BaseException as e:
            raise self._failed(api, spec.name, e, created if first else None) from e
        return self._applied(spec.name, pods, token, km.master_port(spec), sorted(set(restarted)))

    def _failed(self, api: KubeApi, name: str, error: BaseException,
                created: list[tuple[str, str]] | None, served: bool = False) -> BaseException:
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
                note = ("removed what this deploy had created: "
                        + ", ".join(f"{kind} {obj}" for kind, obj in created))
            except Exception as e:  # noqa: BLE001
                note = (f"could not remove what this deploy created ({e}); remove it with "
                        f"`ktlite teardown {name} -n {api.namespace}`")
        elif created:
            note = (f"kept (keep_failed=true): {', '.join(f'{kind} {obj}' for kind, obj in created)}"
                    f"; `ktlite teardown {name} -n {api.namespace}` removes them")
        else:
            parts = ("its Deployment and HorizontalPodAutoscaler (or Knative Service), replicas" if served
                     else f"StatefulSet {name} and its pods")
            note = (f"the deployment's objects ({parts}, Service, Secrets, "
                    f"volumes) are still there; `ktlite teardown {name} -n {api.namespace}` removes "
                    "them")
        if isinstance(error, DeployError) and error.args and isinstance(error.args[0], str):
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])  # its own type kept
            return error
        error.add_note(note)
        return error

    def _remove(self, api: KubeApi, name: str, created: list[tuple[str, str]]) -> None:
        for kind, obj in reversed(created):  # the StatefulSet (and so its pods) first
            api.delete(kind, obj)
        for pod in api.list("Pod", km.selector(name)):
            api.delete("Pod", pod["metadata"]["name"])

    def _ensure(self, api: KubeApi, obj: dict[str, Any], created: list[tuple[str, str]]) -> None:
        if api.get(obj["kind"], obj["metadata"]["name"]) is None:
            try:
                api.create(obj)
                created.append((obj["kind"], obj["metadata"]["name"]))
            except KubeApiError as e:
                if e.status != 409:  # created concurrently: fine
                    raise

    def _drop_policy(self, api: KubeApi, name: str, only_if_there: bool = False) -> bool:
        """Delete the deployment's NetworkPolicy (``distribute("monarch")``), if any (asked
        first with ``only_if_there``: a redeploy that changes nothing writes nothing). Without
        the right to manage policies it has none: ktlite could not have made one."""
        try:
            if only_if_there and api.get("NetworkPolicy", name) is None:
                return False
            return api.delete("NetworkPolicy", name)
        except KubeApiError as e:
            if e.status in (403, 404):  # forbidden, or the API group is not served
                return False
            raise

    def _check_user_secrets(self, api: KubeApi, name: str, objects: list[dict[str, Any]],
                            resolved: list[Resolved]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Each Secret of the user's values with the one there now (None: absent); ConfigError,
        before anything is made, for an existing Secret named alone that is not there, and for
        a Secret of ours that another owner has (unless its ``override=True``)."""
        override = {km.user_secret_name(name, r.key): r.secret.override for r in resolved}
        for r in resolved:
            if r.existing and api.get("Secret", r.existing) is None:
                raise ConfigError(f"secrets names Kubernetes Secret {r.existing!r}, which does not exist in "
                                  f"namespace {api.namespace!r}; create it (kubectl -n {api.namespace} create "
                                  f"secret generic {r.existing} --from-literal=KEY=VALUE), or name a provider "
                                  "preset or kt.secret(...) with values")
        out = []
        for obj in objects:
            if obj["kind"] != "Secret" or km.SECRET_LABEL not in obj["metadata"]["labels"]:
                continue
            current = api.get("Secret", obj["metadata"]["name"])
            owner = ((current or {}).get("metadata", {}).get("labels") or {}).get(km.NAME_LABEL)
            if current is not None and owner != name and not override[obj["metadata"]["name"]]:
                key = obj["metadata"]["labels"][km.SECRET_LABEL]
                raise ConfigError(f"Kubernetes Secret {obj['metadata']['name']!r} already exists in namespace "
                                  f"{api.namespace!r} and deployment {name!r} did not make it; pass "
                                  f"kt.secret(..., override=True) to replace its data (secret {key!r}), or give "
                                  "the secret another name=")
            out.append((obj, current))
        return out

    def _apply_user_secret(self, api: KubeApi, obj: dict[str, Any], current: dict[str, Any] | None,
                           created: list[tuple[str, str]]) -> None:
        if current is None:
            api.create(obj)
            created.append(("Secret", obj["metadata"]["name"]))
        elif current.get("data") != obj["data"] or \
                (current["metadata"].get("labels") or {}) != obj["metadata"]["labels"]:
            api.replace(obj, current["metadata"]["resourceVersion"])

    def _drop_stale_secrets(self, api: KubeApi, name: str, keep: set[str]) -> None:
        """Delete the Secrets of values this deployment no longer names."""
        for obj in api.list("Secret", km.selector(name)):
            meta = obj["metadata"]
            if km.SECRET_LABEL in (meta.get("labels") or {}) and meta["name"] not in keep:
                api.delete("Secret", meta["name"])

    def _apply_secret(self, api: KubeApi, secret: dict[str, Any], token: str,
                      created: list[tuple[str, str]]) -> bool:
        """Create or update the token Secret; True if running pods may hold another token
        (a missing Secret counts: its pods started with the deleted one's)."""
        current = api.get("Secret", secret["metadata"]["name"])
        if current is None:
            api.create(secret)
            created.append(("Secret", secret["metadata"]["name"]))
            return True
        if _decode_token(current) == token:
            return False
        api.replace(secret, current["metadata"]["resourceVersion"])
        return True

    def _apply_statefulset(self, api: KubeApi, sts: dict[str, Any], roll_all: bool) -> list[int]:
        """Create or update one StatefulSet; delete its pods whose template is out of date (the
        controller re-creates them). Returns the ordinals that get new pods."""
        name = sts["metadata"]["name"]
        start, replicas = _first_ordinal(sts), sts["spec"]["replicas"]
        ordinals = range(start, start + replicas)
        current = api.get("StatefulSet", name)
        if current is None:
            api.create(sts)
            return list(ordinals)
        want = _pod_hash(sts["spec"]["template"])
        old_replicas = current["spec"].get("replicas", 0)
        if _pod_hash(current["spec"]["template"]) != want:
            try:
                api.replace(sts, current["metadata"]["resourceVersion"])
            except KubeApiError as e:
                if e.status != 422:  # an immutable field differs (an older ktlite made it, or its selector)
                    raise
                api.delete("StatefulSet", name, propagation="Foreground")
                self._wait_gone(api, "StatefulSet", name, 60.0)
                api.create(sts)
                return list(ordinals)
        elif old_replicas != replicas:
            api.patch("StatefulSet", name, {"spec": {"replicas": replicas}})
        restarted = list(range(start + old_replicas, start + replicas))  # new ordinals of a scale-up
        present = set()
        for pod in api.list("Pod", _match(sts)):
            ordinal = _ordinal(pod)
            present.add(ordinal)
            if ordinal in ordinals and (roll_all or _pod_hash(pod) != want) \
                    and not pod["metadata"].get("deletionTimestamp"):
                api.delete("Pod", pod["metadata"]["name"])
                restarted.append(ordinal)
        restarted += [i for i in ordinals if i not in present]
        return sorted(set(restarted))

    def _remove_stale_parts(self, api: KubeApi, name: str, keep: set[str]) -> None:
        """Delete this deployment's StatefulSets that the new shape has no place for (pods of
        other sizes); their pods go with them. Before the others are applied, so no two
        StatefulSets ever claim a pod."""
        for sts in api.list("StatefulSet", km.selector(name)):
            if sts["metadata"]["name"] not in keep:
                api.delete("StatefulSet", sts["metadata"]["name"], propagation="Foreground")
                self._wait_gone(api, "StatefulSet", sts["metadata"]["name"], 60.0)

    def _wait_gone(self, api: KubeApi, kind: str, name: str, timeout: float) -> None:
        deadline = self._clock() + timeout
        while api.get(kind, name) is not None:
            if self._clock() > deadline:
                raise DeployError(f"{kind} {name} was still being deleted after {timeout:g}s")
            self._sleep(POLL_S)

    def wait_ready(self, api: KubeApi, spec: DeploymentSpec, want: dict[int, str]) -> list[dict[str, Any]]:
        """Pods 0..N-1, each running its StatefulSet's template (``want``: ordinal → pod hash)
        and answering; fails early with the reason a pod cannot start, and after
        ``launch_timeout`` with the last reason seen.

        A pod counts as soon as its server answers /health, which we ask ourselves: waiting
        for the kubelet's readiness probe (and then for the next poll) would round every
        cold start up by a second or two. Polls start fast and slow down as the wait goes on."""
        n = spec.workers
        timeout = spec.pod.calls.launch_timeout
        start = self._clock()
        deadline = start + timeout
        last_line, last_reason = "", "no pod was created yet"
        answering: set[str] = set()  # uids of pods whose server answered
        while True:
            pods = {_ordinal(p): p for p in api.list("Pod", km.selector(spec.name))
                    if _pod_hash(p) == want.get(_ordinal(p)) and not p["metadata"].get("deletionTimestamp")}
            current = [pods[i] for i in range(n) if i in pods]
            line = progress(current, n)
            if line != last_line:
                self._say(f"{spec.name}: {line}")
                last_line = line
            if len(current) == n and all(self._serving(api, p, answering) for p in current):
                return current
            for pod in current:
                problem = diagnose(pod, scaling_up=lambda p: self._scaling_up(api, p),
                                   claims=lambda p: self._claims_problem(api, p))
                if problem is None:
                    continue
                if problem.fatal:
                    raise deploy_error(problem, self._explain(api, spec, problem))
                last_reason = problem.message
            now = self._clock()
            if now > deadline:
                raise LaunchTimeout(
                    f"deployment {spec.name!r} was not ready after launch_timeout={timeout:g}s: {line}; "
                    f"last reason: {last_reason}. Raise launch_timeout, or look at "
                    f"`kubectl -n {api.namespace} describe pod {spec.name}-0`")
            self._sleep(min(POLL_S, 0.1 + (now - start) / 20))

    def _serving(self, api: KubeApi, pod: dict[str, Any], answering: set[str]) -> bool:
        """Ready, or its server already answers /health (asked once it runs)."""
        uid = pod["metadata"].get("uid", "")
        if _is_ready(pod) or uid in answering:
            return True
        status = pod.get("status") or {}
        running = any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or [])
        if status.get("phase") != "Running" or not status.get("podIP") or not running:
            return False
        http, info = self._connect()
        try:
            if info.in_cluster:  # straight to the pod, without the API credentials
                ok = httpx.get(f"{_url(status['podIP'], km.SERVER_PORT)}/health", timeout=2.0).status_code == 200
            else:
                url = api.proxy_url(pod["metadata"]["name"], km.SERVER_PORT)
                ok = http.get(f"{url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            answering.add(uid)
        return ok

    def _scaling_up(self, api: KubeApi, pod: dict[str, Any]) -> bool:
        """True if the cluster autoscaler is adding a node for this unschedulable pod."""
        events = api.list("Event", field_selector=f"involvedObject.name={pod['metadata']['name']}")
        return any(e.get("reason") == "TriggeredScaleUp" for e in events)

    def _claims_problem(self, api: KubeApi, pod: dict[str, Any]) -> str | None:
        """Why a claim ``pod`` mounts will not bind, or None while it may still: a missing
        claim, or one the provisioner failed (no such StorageClass, an access mode it cannot
        give) or that no volume can match and no StorageClass would provision."""
        for volume in pod["spec"].get("volumes") or []:
            name = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not name:
                continue
            claim = api.get("PersistentVolumeClaim", name)
            if claim is None:
                return f"PersistentVolumeClaim {name!r} does not exist"
            if (claim.get("status") or {}).get("phase") == "Bound":
                continue
            events = api.list("Event", field_selector=f"involvedObject.name={name},"
                              "involvedObject.kind=PersistentVolumeClaim")
            for event in sorted(events, key=lambda e: e.get("lastTimestamp") or "", reverse=True):
                reason, message = event.get("reason", ""), event.get("message", "")
                if reason == "ProvisioningFailed" or (reason == "FailedBinding" and
                                                      "no storage class is set" in message):
                    return f"PersistentVolumeClaim {name!r}: {reason}: {message}"
        return None

    def _explain(self, api: KubeApi, spec: DeploymentSpec, problem: PodProblem) -> str:
        text = f"deployment {spec.name!r} cannot start: pod {problem.pod}: {problem.message}"
        if problem.want_logs:
            # the container that failed may be the previous one (restarted since) or the current
            # one (its predecessor's log may be gone): show each log that has text, oldest first
            previous = api.pod_log(problem.pod, tail=30, previous=True)
            current = api.pod_log(problem.pod, tail=30)
            if previous.strip() and current.strip() and previous != current:
                shown = [("the previous container's log", previous), ("the current container's log", current)]
            else:  # one log, or the same one twice (in back-off "current" is the last run's)
                shown = [("its log", log) for log in (previous, current) if log.strip()][:1]
            for label, log in shown:
                text += f"\nlast lines of {label}:\n" + "\n".join("    " + ln for ln in log.splitlines())
        return text + (f"\n{problem.fix}" if problem.fix else "")

    def _applied(self, name: str, pods: list[dict[str, Any]], token: str, master_port: int,
                 restarted: list[int]) -> Applied:
        api = self._api()
        http, info = self._connect()
        endpoints = []
        for pod in sorted(pods, key=_ordinal):
            ip = pod["status"].get("podIP", "")
            pod_name = pod["metadata"]["name"]
            peer = _url(ip, km.SERVER_PORT)
            endpoints.append(PodEndpoint(name=pod_name, ordinal=_ordinal(pod), ip=ip, peer_url=peer,
                                         url=peer if info.in_cluster else api.proxy_url(pod_name, km.SERVER_PORT),
                                         incarnation=_incarnation(pod)))
        return Applied(name=name, backend=self.name, endpoints=endpoints, token=token,
                       master_port=master_port, restarted=restarted,
                       http=None if info.in_cluster else http, spec_hash=_pod_hash(pods[0]) if pods else "")

    # ---- lookup / teardown / list / logs ------------------------------------------------------

    def lookup(self, name: str) -> Applied | None:
        api = self._api()
        if name in self._served_names:  # a serving client asks several times a second: its kind first
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
        token = _decode_token(secret)
        if token is None:
            return None
        want = _ordinal_hashes(statefulsets)
        pods = [p for p in api.list("Pod", km.selector(name))
                if _pod_hash(p) == want.get(_ordinal(p)) and p.get("status", {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")]
        head = next(s for s in statefulsets if s["metadata"]["name"] == name)
        ports = [p.get("containerPort") for p in head["spec"]["template"]["spec"]["containers"][0]["ports"]
                 if p.get("name") == "master"]
        return self._applied(name, pods, token, ports[0] if ports else DEFAULT_MASTER_PORT, [])

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        api = self._api()
        found = False
        for sts in api.list("StatefulSet", km.selector(name)):
            found |= api.delete("StatefulSet", sts["metadata"]["name"])
        found |= api.delete("StatefulSet", name)  # one an older ktlite made without the label
        found |= api.delete("Service", name)
        found |= api.delete("Secret", km.token_secret_name(name))
        for obj in api.list("Secret", km.selector(name)):  # the user's values (kt.secret / presets)
            if km.SECRET_LABEL in (obj["metadata"].get("labels") or {}):
                found |= api.delete("Secret", obj["metadata"]["name"])
        found |= self._drop_policy(api, name)
        found |= self._teardown_served(api, name)
        pods = api.list("Pod", km.selector(name))
        for pod in pods:
            api.delete("Pod", pod["metadata"]["name"])
        if volumes:
            for claim in api.list("PersistentVolumeClaim", km.selector(name)):
                found |= api.delete("PersistentVolumeClaim", claim["metadata"]["name"])
        deadline = self._clock() + timeout
        while pods:
            if self._clock() > deadline:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                raise DeployError(f"teardown of {name!r}: pod(s) {names} were still terminating after "
                                  f"{timeout:g}s; they will go on their own, or check "
                                  f"`kubectl -n {api.namespace} get pods -l {km.selector(name)}`")
            self._sleep(POLL_S / 2)
            pods = api.list("Pod", km.selector(name))
        return found or bool(pods)

    def list(self) -> list[dict[str, Any]]:
        api = self._api()
        rows: dict[str, dict[str, Any]] = {}  # one row per deployment, over its StatefulSets
        managed = ",".join(f"{k}={v}" for k, v in km.MANAGED_LABELS.items())
        for sts in api.list("StatefulSet", managed):
            name = (sts["metadata"].get("labels") or {}).get(km.NAME_LABEL, sts["metadata"]["name"])
            row = rows.setdefault(name, {"name": name, "backend": self.name, "namespace": api.namespace,
                                         "pods": 0, "ready": 0, "detached": True, "autoscaled": False})
            row["pods"] += sts["spec"].get("replicas", 0)
            row["ready"] += (sts.get("status") or {}).get("readyReplicas", 0)
        return [*rows.values(), *self._served_rows(api)]

    def logs(self, name: str, ordinal: int | None = None, follow: bool = False,
             tail: int | None = None) -> Iterator[str]:
        api = self._api()
        pods = sorted(api.list("Pod", km.selector(name)), key=_ordinal)
        if ordinal is not None:
            pods = [p for p in pods if _ordinal(p) == ordinal]
        if not pods:
            which = f"pod {ordinal} of " if ordinal is not None else ""
            raise DeployError(f"no {which}deployment {name!r} in namespace {api.namespace!r}")
        if follow:
            if len(pods) > 1:
                yield from _merge_follow(api, [p["metadata"]["name"] for p in pods], tail)
            else:
                pod_name = pods[0]["metadata"]["name"]
                yield from (f"[{pod_name}] {line}" for line in api.follow_log(pod_name, tail))
            return
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            for line in api.pod_log(pod_name, tail=tail).splitlines():
                yield f"[{pod_name}] {line}"


def _merge_follow(api: KubeApi, pods: list[str], tail: int | None) -> Iterator[str]:
    """Follow several pods' logs at once (one reader thread each), lines as they come."""
    import queue

    lines: queue.Queue[str | None] = queue.Queue()

    def read(pod: str) -> None:
        try:
            for line in api.follow_log(pod, tail):
                lines.put(f"[{pod}] {line}")
        except KubeApiError as e:
            lines.put(f"[{pod}] ktlite: {e}")
        finally:
            lines.put(None)

    for pod in pods:
        threading.Thread(target=read, args=(pod,), daemon=True).start()
    open_streams = len(pods)
    while open_streams:
        item = lines.get()
        if item is None:
            open_streams -= 1
        else:
            yield item


def _incarnation(pod: dict[str, Any]) -> str:
    """The pod's uid, IP and container restarts: any change means a server without our code."""
    status = pod.get("status") or {}
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    return f"{pod['metadata'].get('uid', '')}/{status.get('podIP', '')}/{restarts}"


def _is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _decode_token(secret: dict[str, Any]) -> str | None:
    data = secret.get("data") or {}
    if "token" in data:
        with contextlib.suppress(ValueError):
            return base64.b64decode(data["token"]).decode()
    string_data: str | None = (secret.get("stringData") or {}).get("token")
    return string_data


_PROBLEM_ERRORS: dict[str, type[DeployError]] = {
    "image_pull": ImagePullError, "unschedulable": ResourceNotAvailableError, "secret": SecretNotFound,
    "setup": StartupError, "crash": StartupError, "config": StartupError}


def deploy_error(problem: PodProblem, message: str) -> DeployError:
    """The error a pod's fatal problem fails the deploy with (Kubetorch's names)."""
    if problem.kind in ("oom", "evicted", "failed"):
        return PodTerminatedError(message, pod_name=problem.pod, reason=problem.reason)
    return _PROBLEM_ERRORS.get(problem.kind, DeployError)(message)
