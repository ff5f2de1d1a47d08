"""The data store on Kubernetes: one ``ktlite-store`` pod per namespace, made on first use.

Objects (nothing for an administrator to install): a Secret ``ktlite-store-token`` (the store's
own token), a PersistentVolumeClaim ``ktlite-store`` (the data; kept when the store is torn
down unless asked), and a StatefulSet ``ktlite-store`` of one pod running the ktlite server
image with ``KTLITE_STORE_ROOT=/store`` (``ktlite_server.store``). They are labelled
``ktlite.dev/store=ktlite-store`` and not ``ktlite.dev/name`` nor managed-by ``ktlite``: the
store is no deployment, so ``ktlite list`` does not show it and ``ktlite teardown --all``
leaves it alone; ``ktlite store teardown`` removes its pod (and, with ``--volumes``, the claim
and the Secret, whose key signs the stored objects: they go together).

Reaching it: from outside the cluster through the API server's pod proxy; from a pod by the
store pod's IP (no cluster DNS, no kube-proxy). Pods cannot ask the API for that IP, so the
client hands the store's current address and token to a deployment's pods each time it
pushes code (``handoff``); a pod whose store moved since fails with an error that says so.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import httpx

from ktlite.backends import kube_boot, kube_deps
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_diagnose import diagnose, progress
from ktlite.backends.kube_security import env as security_env
from ktlite.backends.kube_security import harden
from ktlite.errors import ConfigError, DataStoreError, KtliteError
from ktlite.logconfig import pod_env
from ktlite.specs.kube_options import DEFAULT_UID, KubernetesOptions
from ktlite.specs.quantities import parse_memory

NAME = "ktlite-store"
SECRET = "ktlite-store-token"
CLAIM = "ktlite-store"
POD = f"{NAME}-0"
ROOT = "/store"
LABEL = "ktlite.dev/store"
LABELS = {LABEL: NAME, "app.kubernetes.io/part-of": "ktlite"}
DEFAULT_SIZE = "10Gi"
DEFAULT_TIMEOUT_S = 600.0
_SETUP_FIX = (
    "give the store an image that already holds ktlite: `ktlite store create --image IMAGE` "
    "or `ktlite config set image IMAGE` (images/Dockerfile builds one), or `ktlite config set "
    "install SPEC` with a pip spec the pod can install"
)


@dataclass(frozen=True)
class StoreAddress:
    """Where the store pod answers: ``url`` for this process (a pod proxy URL, or the pod IP
    inside the cluster), ``peer_url`` for other pods."""

    pod: str
    namespace: str
    url: str
    peer_url: str
    token: str = field(repr=False)
    http: Any = field(default=None, repr=False)


def render(
    namespace: str,
    *,
    image: str,
    install: str,
    token: str | None,
    size: str = DEFAULT_SIZE,
    storage_class: str | None = None,
    pull_policy: str | None = None,
    run_as_user: int = DEFAULT_UID,
    max_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Pure: the store's objects, in apply order (the Secret holds a placeholder without
    ``token``, for printing). The store refuses uploads beyond ``max_bytes`` in all
    (``KTLITE_STORE_MAX_BYTES``; default: the claim's size). ``run_as_user``: its pod's user
    (0: root, for a volume that ignores ``fsGroup``)."""
    meta = {"namespace": namespace, "labels": dict(LABELS)}
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {**meta, "name": SECRET},
        "stringData": {"token": token if token is not None else km.TOKEN_PLACEHOLDER},
    }
    boot = kube_boot.secret_data([], token)  # ktlite's source for the pod: placeholders in a plan
    secret.update(
        {"data": boot} if token is not None else {"stringData": {**secret["stringData"], **boot}}
    )
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}},
    }
    if storage_class:
        claim_spec["storageClassName"] = storage_class
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**meta, "name": CLAIM},
        "spec": claim_spec,
    }
    env = [
        {"name": "KTLITE_STORE_ROOT", "value": ROOT},
        {"name": "KTLITE_STORE_MAX_BYTES", "value": str(max_bytes or parse_memory(size, "size"))},
        {"name": "KTLITE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KTLITE_PORT", "value": str(km.SERVER_PORT)},
        *([{"name": "KTLITE_INSTALL", "value": install}] if install else []),
        {"name": "KTLITE_FREEZE", "value": "0"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *security_env(),  # the token's path, HOME
        *({"name": k, "value": v} for k, v in pod_env().items()),  # KTLITE_LOG_LEVEL, when set
    ]
    container: dict[str, Any] = {
        "name": km.CONTAINER,
        "image": image,
        "command": ["/bin/sh", "-c", km.BOOTSTRAP],
        "env": env,
        "ports": [{"name": "server", "containerPort": km.SERVER_PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": km.SERVER_PORT},
            "periodSeconds": 2,
            "failureThreshold": 3,
            "timeoutSeconds": 2,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [
            {"name": "ktlite-state", "mountPath": km.STATE_DIR},
            {"name": "data", "mountPath": ROOT},
        ],
    }
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    pod = {
        "containers": [container],
        "terminationGracePeriodSeconds": 10,
        "volumes": [
            {"name": "ktlite-state", "emptyDir": {}},
            {"name": "data", "persistentVolumeClaim": {"claimName": CLAIM}},
        ],
    }
    # the same non-root user and token file as a deployment's pods
    harden(pod, KubernetesOptions(run_as_user=run_as_user), SECRET)
    kube_boot.wire(pod, SECRET, [], token)
    template = {"metadata": {"labels": dict(LABELS)}, "spec": pod}
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {**meta, "name": NAME},
        "spec": {
            "serviceName": NAME,
            "replicas": 1,
            "selector": {"matchLabels": {LABEL: NAME}},
            "template": template,
        },
    }
    return [secret, claim, sts]


def store_user() -> int:
    """The store pod's user id: ``KTLITE_STORE_RUN_AS_USER``, else the pods' default (1000)."""
    text = os.environ.get("KTLITE_STORE_RUN_AS_USER", "").strip()
    if not text:
        return DEFAULT_UID
    if not text.isdigit():
        raise ConfigError(
            f"KTLITE_STORE_RUN_AS_USER={text!r} must be a user id: {DEFAULT_UID} (the default) "
            "or 0 (root, for a StorageClass whose volumes ignore fsGroup, such as hostPath)"
        )
    return KubernetesOptions(run_as_user=int(text)).run_as_user  # validated there


def _max_bytes() -> int | None:
    """``KTLITE_STORE_MAX_BYTES`` of this process, for a store it creates (None: the claim's
    size)."""
    from ktlite_wire.storecap import max_bytes

    try:
        return max_bytes(os.environ)
    except ValueError as e:
        raise DataStoreError(str(e)) from None


def _token(secret: dict[str, Any] | None) -> str | None:
    if secret is None:
        return None
    data = secret.get("data") or {}
    if "token" in data:
        with contextlib.suppress(ValueError):
            return base64.b64decode(data["token"]).decode()
    value: str | None = (secret.get("stringData") or {}).get("token")
    return value


class KubeStore:
    """The store of one namespace, through a :class:`KubernetesBackend` (its API client,
    clock and messages)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @property
    def api(self) -> KubeApi:
        api: KubeApi = self.backend._api()
        return api

    def _address(self, api: KubeApi, pod: dict[str, Any], token: str) -> StoreAddress:

        http, info = self.backend._connect()
        peer = kp.url(pod["status"]["podIP"], km.SERVER_PORT)
        url = peer if info.in_cluster else api.proxy_url(POD, km.SERVER_PORT)
        return StoreAddress(
            pod=POD,
            namespace=api.namespace,
            url=url,
            peer_url=peer,
            token=token,
            http=None if info.in_cluster else http,
        )

    def find(self) -> StoreAddress | None:
        """The store's address if its pod runs with an IP (not checked to answer), else None."""
        api = self.api
        pod = api.get("Pod", POD)
        if (
            pod is None
            or pod["metadata"].get("deletionTimestamp")
            or not (pod.get("status") or {}).get("podIP")
        ):
            return None
        token = _token(api.get("Secret", SECRET))
        return None if token is None else self._address(api, pod, token)

    def exists(self) -> bool:
        return self.api.get("StatefulSet", NAME) is not None

    def ensure(
        self,
        timeout: float | None = None,
        size: str | None = None,
        storage_class: str | None = None,
        image: str | None = None,
    ) -> StoreAddress:
        """Create what is missing of the store, then wait (at most ``timeout`` seconds) for
        its pod to answer; fails early with the reason it cannot start. A store this call
        created and that does not start is removed again (a claim from before, which may hold
        data, is kept), and the error names the command that removes what is left."""
        from ktlite.config import get as setting

        api = self.api
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        start = self.backend._clock()
        self._wait_released(api, timeout)
        token = _token(api.get("Secret", SECRET))
        new_token = token is None
        if new_token:
            token = secrets.token_urlsafe(32)
        objects = render(
            api.namespace,
            image=image or km.default_image(),
            install=km.install_spec(),
            token=token,
            size=size or os.environ.get("KTLITE_STORE_SIZE") or DEFAULT_SIZE,
            storage_class=storage_class or os.environ.get("KTLITE_STORE_STORAGE_CLASS") or None,
            pull_policy=setting("image_pull_policy"),
            run_as_user=store_user(),
            max_bytes=_max_bytes(),
        )
        missing = [o for o in objects if api.get(o["kind"], o["metadata"]["name"]) is None]
        if missing:
            kube_deps.ensure(api)  # the server's packages, for an image that lacks them
        created: list[str] = []  # the kinds this call made (each named NAME, SECRET or CLAIM)
        try:
            for obj in missing:
                try:
                    api.create(obj)
                    created.append(obj["kind"])
                except KubeApiError as e:
                    if e.status != 409:  # 409: made concurrently (another process's ensure)
                        raise DataStoreError(
                            f"could not create the data store in namespace {api.namespace!r}: {e}"
                        ) from e
            if new_token and "StatefulSet" not in created:
                # the pod started with a Secret that is gone: it must restart to read the new one
                with contextlib.suppress(KubeApiError):
                    api.delete("Pod", POD)
            if created:
                self.backend._say(
                    f"creating the data store in namespace {api.namespace!r} "
                    f"({', '.join(created)} {NAME})"
                )
            assert token is not None
            return self.wait(token, max(0.0, timeout - (self.backend._clock() - start)))
        except BaseException as e:
            self._roll_back(api, e, [o["kind"] for o in missing], created)
            raise

    def _wait_released(self, api: KubeApi, timeout: float) -> None:
        """A claim being deleted (a store torn down or rolled back a moment ago) stays until
        its pod has gone (pvc-protection): wait for it, or the new pod would mount a claim
        about to vanish."""
        clock, start = self.backend._clock, self.backend._clock()
        while (claim := api.get("PersistentVolumeClaim", CLAIM)) is not None and claim[
            "metadata"
        ].get("deletionTimestamp"):
            if clock() - start > timeout:
                raise DataStoreError(
                    f"the data store's PersistentVolumeClaim {CLAIM!r} in namespace {api.namespace!r} "
                    f"was still being deleted after {timeout:g}s; a pod still mounts it (`kubectl -n "
                    f"{api.namespace} get pods`); try again once it is gone"
                )
            self.backend._sleep(0.5)

    def _roll_back(
        self, api: KubeApi, error: BaseException, missing: list[str], created: list[str]
    ) -> None:
        """After a failed ``ensure`` that found the kinds ``missing`` and ``created`` some: a
        new store is removed again (a claim from before, which may hold data, stays; nothing
        is removed with the keep_failed setting); ``error`` says what is left and the command
        that removes it."""
        from ktlite.config import get as setting

        command = f"ktlite store teardown --backend kubernetes -n {api.namespace}"
        keep = (setting("keep_failed") or "").lower() == "true"
        new_store = "StatefulSet" in missing
        if new_store and not created:  # it failed before making anything
            return
        if not isinstance(error, Exception):  # Ctrl-C: roll back too, say nothing
            if new_store and not keep:
                with contextlib.suppress(Exception):
                    self._remove(api, created)
            return
        names = {
            "StatefulSet": f"StatefulSet {NAME}",
            "Secret": f"Secret {SECRET}",
            "PersistentVolumeClaim": f"PersistentVolumeClaim {CLAIM}",
        }
        made = ", ".join(names[kind] for kind in created)
        old_claim = "PersistentVolumeClaim" not in missing
        data = (
            (
                f"; kept PersistentVolumeClaim {CLAIM!r}, which holds the store's data from before: "
                f"`{command} --volumes` deletes it with that data"
            )
            if old_claim
            else ""
        )
        if new_store and not keep:
            try:
                self._remove(api, created)
                note = f"removed what this attempt created ({made}){data}"
            except Exception as e:  # noqa: BLE001 - the store's own error matters more
                note = (
                    f"could not remove what this attempt created ({made}): {e}; `{command}"
                    f"{'' if old_claim else ' --volumes'}` removes it"
                )
        elif new_store:
            note = (
                f"kept (keep_failed=true): {made}; `{command}` removes them (its claim and data "
                f"too with --volumes)"
            )
        else:
            note = (
                f"the data store from before is still there (StatefulSet {NAME}, its pod, Secret "
                f"{SECRET}, PersistentVolumeClaim {CLAIM}); `{command}` removes it and keeps the "
                f"data, `{command} --volumes` deletes the data too; then try again"
            )
        if isinstance(error, KtliteError) and error.args and isinstance(error.args[0], str):
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])  # its own type kept
        elif hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(note)

    def _remove(self, api: KubeApi, created: list[str]) -> None:
        """Delete what this attempt ``created`` (not what another process made meanwhile)."""
        if "StatefulSet" in created:
            api.delete("StatefulSet", NAME)
            api.delete("Pod", POD)
        if "PersistentVolumeClaim" in created:  # Terminating until the pod has gone
            api.delete("PersistentVolumeClaim", CLAIM)
        if "Secret" in created:
            api.delete("Secret", SECRET)

    def wait(self, token: str, timeout: float) -> StoreAddress:
        api = self.api
        clock, sleep = self.backend._clock, self.backend._sleep
        start = clock()
        last, reason = "", "no pod was created yet"
        while True:
            pod = api.get("Pod", POD)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                line = progress([pod], 1)
                if line != last and clock() - start > 1.0:
                    self.backend._say(f"{NAME}: {line}")
                    last = line
                if (pod.get("status") or {}).get("podIP"):
                    address = self._address(api, pod, token)
                    if self.answers(address):
                        return address
                problem = diagnose(pod, claims=lambda p: self._claim_problem(api))
                if problem is not None:
                    if problem.fatal:
                        log = api.pod_log(POD, tail=20) if problem.want_logs else ""
                        fix = _SETUP_FIX if problem.kind == "setup" else problem.fix
                        raise DataStoreError(
                            f"the data store cannot start: pod {POD} in namespace "
                            f"{api.namespace!r}: {problem.message}"
                            + (f"; {fix}" if fix else "")
                            + (f"\nlast lines of its log:\n{log.rstrip()}" if log.strip() else "")
                        )
                    reason = problem.message
            if clock() - start > timeout:
                claim = api.get("PersistentVolumeClaim", CLAIM)
                if claim is not None and (claim.get("status") or {}).get("phase") != "Bound":
                    raise DataStoreError(
                        f"the data store's PersistentVolumeClaim {CLAIM!r} in namespace {api.namespace!r} "
                        f"was not bound after {timeout:g}s; check `kubectl -n {api.namespace} describe pvc "
                        f"{CLAIM}` (set KTLITE_STORE_STORAGE_CLASS to a StorageClass of "
                        "`kubectl get storageclass`), then `ktlite store teardown --volumes` and try again"
                    )
                raise DataStoreError(
                    f"the data store pod {POD} in namespace {api.namespace!r} was not "
                    f"ready after {timeout:g}s (last reason: {reason}); look at "
                    f"`kubectl -n {api.namespace} describe pod {POD}`, or raise "
                    "KTLITE_STORE_TIMEOUT"
                )
            sleep(min(1.0, 0.1 + (clock() - start) / 20))

    def answers(self, address: StoreAddress) -> bool:
        try:
            client = address.http or httpx
            return bool(client.get(f"{address.url}/health", timeout=3.0).status_code == 200)
        except httpx.HTTPError:
            return False

    def _claim_problem(self, api: KubeApi) -> str | None:
        claim = api.get("PersistentVolumeClaim", CLAIM)
        if claim is None:
            return f"PersistentVolumeClaim {CLAIM!r} does not exist"
        if (claim.get("status") or {}).get("phase") == "Bound":
            return None
        events = api.list(
            "Event",
            field_selector=f"involvedObject.name={CLAIM},involvedObject.kind=PersistentVolumeClaim",
        )
        for event in events:
            if event.get("reason") == "ProvisioningFailed":
                return (
                    f"PersistentVolumeClaim {CLAIM!r}: ProvisioningFailed: {event.get('message', '')}; "
                    "set KTLITE_STORE_STORAGE_CLASS, then `ktlite store teardown --volumes`"
                )
        return None

    def teardown(self, volumes: bool = False) -> bool:
        """Delete the store (its data too with ``volumes``); True if something was there. The
        Secret goes with the data only: its key signs the stored objects, so a store made again
        over the kept claim must have the same key to read them back."""
        api = self.api
        found = api.delete("StatefulSet", NAME)
        found |= api.delete("Pod", POD)
        if volumes:
            found |= api.delete("Secret", SECRET)
            found |= api.delete("PersistentVolumeClaim", CLAIM)
        return found


def handoff(backend: Any) -> dict[str, Any] | None:
    """What a deployment's pods need to reach the store: its pod IP URL and token, or
    ``{"url": None}`` when the namespace has no running store. None when the API could not
    tell (the pods keep what they had)."""
    try:
        address = KubeStore(backend).find()
    except Exception:  # noqa: BLE001 - the deploy must not fail for the store's sake
        return None
    if address is None:
        return {"url": None, "namespace": backend.namespace}
    return {
        "url": address.peer_url,
        "token": address.token,
        "pod": address.pod,
        "namespace": address.namespace,
    }
