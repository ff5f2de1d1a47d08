"""Fixtures of the opt-in real-cluster suite: ``pytest -m kubernetes tests/kubernetes``.

The tests here run only when ``KTLITE_TEST_KUBECONFIG`` names a kubeconfig; without it
``tests/conftest.py`` skips them and nothing below touches a cluster. Settings:

- ``KTLITE_TEST_KUBECONFIG``: kubeconfig of the test cluster (required). For the session it
  becomes ``KUBECONFIG`` and ``KTLITE_KUBECONFIG`` (ktlite's own setting, which would win).
- ``KTLITE_TEST_CONTEXT``: a context of it (default: its current-context); becomes
  ``KTLITE_CONTEXT`` for the session.
- ``KTLITE_TEST_NAMESPACE``: namespace of every object (default ``default``; must exist).
- ``KTLITE_TEST_IMAGE``: server image (default ``ktlite-server:dev``, images/Dockerfile).
- ``KTLITE_TEST_TORCH_IMAGE``: image with torch for the gloo test (default
  ``ktlite-server-pytorch:dev``, images/Dockerfile.pytorch); empty skips that test.
- ``KTLITE_TEST_BARE_IMAGE``: an image with a Python 3.11 and none of the pod server's
  packages (default ``ktlite-no-server-packages:dev``: ``images/Dockerfile.bare``); empty
  skips the test that the client ships them.
- ``KTLITE_TEST_IMAGE_PULL_POLICY``: ``IfNotPresent`` (default); ``Never`` for images loaded
  into kind or minikube.
- ``KTLITE_TEST_STORAGE_CLASS``: StorageClass of the volume test (default: the cluster's).
- ``KTLITE_TEST_SKIP_VOLUMES=1``: skip the volume test (or deselect the marker
  ``kubernetes_volumes``).
- ``KTLITE_TEST_GPUS``: how many ``nvidia.com/gpu`` the cluster can schedule at once (default
  0). The uneven GPU pods test needs 4 (it requests them; its ranks use gloo on CPU, so a node
  that only advertises the resource will do: see docs/kubernetes.md).
- ``KTLITE_TEST_VOLUME_RUN_AS_USER``: the user the pods that mount a volume (the volume test,
  the data store) run as; default: ktlite's (1000, non-root). ``0`` where the StorageClass
  ignores ``fsGroup`` and makes volumes only root can write (hostPath, as on a one-node test
  cluster such as ``../shared/cluster``).

The backend is always passed explicitly (``Compute(backend="kubernetes")``).

Every deployment is called ``kt-test-<6 hex>-<case>`` (one random prefix per session, and
per pytest-xdist worker); each test tears its deployments down in a finalizer, also when it
fails, and the session ends with a sweep of every object labelled
``app.kubernetes.io/managed-by=ktlite`` whose name starts with this run's prefix.

This directory must have no ``__init__.py``: with one, pytest imports it as the top-level
package ``kubernetes``, which shadows the official client in the whole test process (ktlite's
own backend included), and ``cluster_funcs`` would become ``kubernetes.cluster_funcs``, a
dotted name that ktlite does not ship by value.

The official client is imported inside fixtures only, so collecting this directory never
needs it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import ktlite as kt

MANAGED_BY = "app.kubernetes.io/managed-by=ktlite"
NAME_LABEL = "ktlite.dev/name"
# what a deployment creates, in deletion order (the StatefulSet before its pods); the same
# kinds ktlite itself needs rights on (docs/kubernetes.md), so the suite needs no others
KINDS = (
    "horizontalpodautoscalers",
    "deployments",
    "statefulsets",
    "services",
    "secrets",
    "networkpolicies",
    "serviceaccounts",  # with the Role and RoleBinding: a deployment with an inactivity_ttl
    "roles",
    "rolebindings",
    "pods",
    "persistentvolumeclaims",
)
WITHOUT_VOLUMES = KINDS[:-1]
REQUEST_TIMEOUT = 30  # seconds, for every Kubernetes API request made here


# ---- settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    kubeconfig: str
    context: str | None
    namespace: str
    image: str
    torch_image: str
    pull_policy: str
    storage_class: str | None
    skip_volumes: bool
    gpus: int = 0
    # the pods' user where a volume is mounted: None (ktlite's default, 1000) where the
    # StorageClass applies fsGroup; 0 where it does not (hostPath, as on a one-node test cluster)
    volume_user: int | None = None
    ray_image: str = ""
    monarch_image: str = ""
    bare_image: str = ""


@pytest.fixture(scope="session")
def settings() -> Settings:
    kubeconfig = os.environ.get("KTLITE_TEST_KUBECONFIG", "")
    if not kubeconfig:
        pytest.skip("set KTLITE_TEST_KUBECONFIG to run against a real cluster")
    kubeconfig = os.path.expanduser(kubeconfig)
    if not os.path.isfile(kubeconfig):
        pytest.fail(
            f"KTLITE_TEST_KUBECONFIG={kubeconfig!r} is not a file; point it at the "
            "test cluster's kubeconfig, e.g. ~/.kube/config",
            pytrace=False,
        )
    return Settings(
        kubeconfig=kubeconfig,
        context=os.environ.get("KTLITE_TEST_CONTEXT") or None,
        namespace=os.environ.get("KTLITE_TEST_NAMESPACE") or "default",
        image=os.environ.get("KTLITE_TEST_IMAGE") or "ktlite-server:dev",
        torch_image=os.environ.get("KTLITE_TEST_TORCH_IMAGE", "ktlite-server-pytorch:dev"),
        ray_image=os.environ.get("KTLITE_TEST_RAY_IMAGE", "ktlite-server-ray:dev"),
        monarch_image=os.environ.get("KTLITE_TEST_MONARCH_IMAGE", "ktlite-server-monarch:dev"),
        bare_image=os.environ.get("KTLITE_TEST_BARE_IMAGE", "ktlite-no-server-packages:dev"),
        pull_policy=os.environ.get("KTLITE_TEST_IMAGE_PULL_POLICY") or "IfNotPresent",
        storage_class=os.environ.get("KTLITE_TEST_STORAGE_CLASS") or None,
        skip_volumes=os.environ.get("KTLITE_TEST_SKIP_VOLUMES", "") not in ("", "0"),
        gpus=int(os.environ.get("KTLITE_TEST_GPUS") or 0),
        volume_user=(
            int(os.environ["KTLITE_TEST_VOLUME_RUN_AS_USER"])
            if os.environ.get("KTLITE_TEST_VOLUME_RUN_AS_USER")
            else None
        ),
    )


_SESSION_ENV = ("KUBECONFIG", "KTLITE_KUBECONFIG", "KTLITE_CONTEXT")


@pytest.fixture(scope="session", autouse=True)
def _kubeconfig(settings: Settings) -> Iterator[str]:
    """Point ktlite at the test cluster for the session; the environment is restored after.

    ``KUBECONFIG`` is the test kubeconfig. ktlite's own settings are pinned too (they win over
    ``KUBECONFIG``): ``KTLITE_KUBECONFIG`` to the same file, so a value left in the shell
    cannot send the suite to another cluster, and ``KTLITE_CONTEXT`` to
    ``KTLITE_TEST_CONTEXT`` (unset: the kubeconfig's current-context).
    """
    old = {k: os.environ.get(k) for k in _SESSION_ENV}
    os.environ["KUBECONFIG"] = settings.kubeconfig
    os.environ["KTLITE_KUBECONFIG"] = settings.kubeconfig
    if settings.context:
        os.environ["KTLITE_CONTEXT"] = settings.context
    else:
        os.environ.pop("KTLITE_CONTEXT", None)
    try:
        yield settings.kubeconfig
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- the Kubernetes API, seen by the tests ---------------------------------------------------


class Kube:
    """The few Kubernetes API reads and deletes the tests need, in one namespace.

    Uses its own ``ApiClient`` (never the client library's global configuration, which
    ktlite's backend may set up too). Every request has a timeout.
    """

    def __init__(self, settings: Settings) -> None:
        from kubernetes import client, config

        self.namespace = settings.namespace
        self.api = config.new_client_from_config(
            config_file=settings.kubeconfig, context=settings.context, persist_config=False
        )
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.storage = client.StorageV1Api(self.api)
        self.networking = client.NetworkingV1Api(self.api)
        self.autoscaling = client.AutoscalingV2Api(self.api)
        rbac = client.RbacAuthorizationV1Api(self.api)
        ns, core, apps, net, scaling = (
            self.namespace,
            self.core,
            self.apps,
            self.networking,
            self.autoscaling,
        )
        self._list = {
            "horizontalpodautoscalers": lambda **kw: (
                scaling.list_namespaced_horizontal_pod_autoscaler(ns, **kw)
            ),
            "deployments": lambda **kw: apps.list_namespaced_deployment(ns, **kw),
            "statefulsets": lambda **kw: apps.list_namespaced_stateful_set(ns, **kw),
            "services": lambda **kw: core.list_namespaced_service(ns, **kw),
            "secrets": lambda **kw: core.list_namespaced_secret(ns, **kw),
            "pods": lambda **kw: core.list_namespaced_pod(ns, **kw),
            "persistentvolumeclaims": lambda **kw: core.list_namespaced_persistent_volume_claim(
                ns, **kw
            ),
            "networkpolicies": lambda **kw: net.list_namespaced_network_policy(ns, **kw),
            "serviceaccounts": lambda **kw: core.list_namespaced_service_account(ns, **kw),
            "roles": lambda **kw: rbac.list_namespaced_role(ns, **kw),
            "rolebindings": lambda **kw: rbac.list_namespaced_role_binding(ns, **kw),
        }
        self._delete = {
            "horizontalpodautoscalers": lambda n, **kw: (
                scaling.delete_namespaced_horizontal_pod_autoscaler(n, ns, **kw)
            ),
            "deployments": lambda n, **kw: apps.delete_namespaced_deployment(n, ns, **kw),
            "statefulsets": lambda n, **kw: apps.delete_namespaced_stateful_set(n, ns, **kw),
            "services": lambda n, **kw: core.delete_namespaced_service(n, ns, **kw),
            "secrets": lambda n, **kw: core.delete_namespaced_secret(n, ns, **kw),
            "pods": lambda n, **kw: core.delete_namespaced_pod(n, ns, **kw),
            "persistentvolumeclaims": lambda n, **kw: (
                core.delete_namespaced_persistent_volume_claim(n, ns, **kw)
            ),
            "networkpolicies": lambda n, **kw: net.delete_namespaced_network_policy(n, ns, **kw),
            "serviceaccounts": lambda n, **kw: core.delete_namespaced_service_account(n, ns, **kw),
            "roles": lambda n, **kw: rbac.delete_namespaced_role(n, ns, **kw),
            "rolebindings": lambda n, **kw: rbac.delete_namespaced_role_binding(n, ns, **kw),
        }

    def close(self) -> None:
        self.api.close()

    def check(self) -> None:
        """Fail the session early, and clearly, when the cluster or namespace is not there."""
        from kubernetes.client.rest import ApiException

        try:
            self.core.list_namespaced_pod(self.namespace, limit=1, _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001
            pytest.fail(
                f"cannot list pods in namespace {self.namespace!r} of the cluster of "
                f"KTLITE_TEST_KUBECONFIG: {type(e).__name__}: {e}",
                pytrace=False,
            )
        try:
            self.core.read_namespace(self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                pytest.fail(
                    f"namespace {self.namespace!r} does not exist; create it "
                    f"(kubectl create namespace {self.namespace}) or set "
                    "KTLITE_TEST_NAMESPACE",
                    pytrace=False,
                )
            # 403: no right to read namespaces; the tests will say what else is missing

    # reads

    def list(self, kind: str, selector: str) -> list[Any]:
        return list(
            self._list[kind](label_selector=selector, _request_timeout=REQUEST_TIMEOUT).items
        )

    def remaining(self, selector: str, kinds: tuple[str, ...] = KINDS) -> dict[str, list[str]]:
        """kind -> names of the objects matching ``selector`` (kinds with none left out)."""
        out = {}
        for kind in kinds:
            names = sorted(o.metadata.name for o in self.list(kind, selector))
            if names:
                out[kind] = names
        return out

    def wait_gone(
        self, selector: str, kinds: tuple[str, ...] = KINDS, timeout: float = 120.0
    ) -> dict[str, list[str]]:
        """Poll until nothing matching ``selector`` is left; returns what is left at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.remaining(selector, kinds)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)

    def pods(self, name: str) -> list[Any]:
        """The pods of deployment ``name``, in ordinal order."""
        pods = self.list("pods", f"{NAME_LABEL}={name}")
        return sorted(pods, key=lambda p: int(p.metadata.name.rsplit("-", 1)[-1]))

    def pod(self, pod_name: str) -> Any:
        return self.core.read_namespaced_pod(
            pod_name, self.namespace, _request_timeout=REQUEST_TIMEOUT
        )

    def has_default_storage_class(self) -> bool | None:
        """True/False; None when this user may not list StorageClasses."""
        from kubernetes.client.rest import ApiException

        try:
            classes = self.storage.list_storage_class(_request_timeout=REQUEST_TIMEOUT).items
        except ApiException:
            return None
        keys = (
            "storageclass.kubernetes.io/is-default-class",
            "storageclass.beta.kubernetes.io/is-default-class",
        )
        return any((sc.metadata.annotations or {}).get(k) == "true" for sc in classes for k in keys)

    # deletes

    def delete(self, kind: str, name: str) -> None:
        """Delete one object; already gone is fine."""
        from kubernetes.client.rest import ApiException

        # the answer (the object or a Status, depending on the kind) is not needed: read raw
        kwargs: dict[str, Any] = {"_request_timeout": REQUEST_TIMEOUT, "_preload_content": False}
        if kind in ("statefulsets", "deployments"):
            kwargs["propagation_policy"] = "Background"
        elif kind == "pods":
            kwargs["grace_period_seconds"] = 5
        try:
            response = self._delete[kind](name, **kwargs)
        except ApiException as e:
            if e.status != 404:
                raise
            return
        response.read()
        response.release_conn()

    def delete_matching(
        self,
        selector: str,
        keep: Callable[[Any], bool] = lambda obj: True,
        kinds: tuple[str, ...] = KINDS,
    ) -> list[str]:
        """Delete what ``selector`` (and ``keep``) select; returns ``kind/name`` of each."""
        deleted = []
        for kind in kinds:
            for obj in self.list(kind, selector):
                if keep(obj):
                    self.delete(kind, obj.metadata.name)
                    deleted.append(f"{kind}/{obj.metadata.name}")
        return deleted


@pytest.fixture(scope="session")
def kube(settings: Settings, _kubeconfig: str) -> Iterator[Kube]:
    k = Kube(settings)
    try:
        k.check()
        yield k
    finally:
        k.close()


# ---- names and cleanup -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def run_prefix() -> str:
    """``kt-test-<6 hex>``: the prefix of every object this session creates."""
    return f"kt-test-{secrets.token_hex(3)}"


@pytest.fixture(scope="session", autouse=True)
def _sweep(kube: Kube, run_prefix: str) -> Iterator[None]:
    """At session end, delete whatever this run left behind (labelled managed-by=ktlite)."""
    yield

    def ours(obj: Any) -> bool:
        labels = obj.metadata.labels or {}
        return obj.metadata.name.startswith(run_prefix) or labels.get(NAME_LABEL, "").startswith(
            run_prefix
        )

    try:
        left = kube.delete_matching(MANAGED_BY, ours)
    except Exception as e:  # noqa: BLE001
        print(f"\nktlite test sweep failed: {type(e).__name__}: {e}")
        return
    if left:
        print(f"\nktlite test sweep deleted {len(left)} leftover object(s): {', '.join(left)}")


class Deployments:
    """Creates uniquely named deployments and removes them again.

    ``cleanup()`` tears every handle down through ktlite (``teardown(volumes=True)``), then
    deletes whatever still carries the deployment's ``ktlite.dev/name`` label, so it also
    cleans up after a ``.to()`` that failed halfway.
    """

    def __init__(self, kube: Kube, prefix: str) -> None:
        self.kube = kube
        self.prefix = prefix
        self.names: list[str] = []
        self.remotes: list[Any] = []

    def name(self, case: str) -> str:
        """A fresh deployment name ``<prefix>-<case>``, cleaned up with this fixture."""
        name = f"{self.prefix}-{case}"
        if name in self.names:
            name = f"{name}-{secrets.token_hex(2)}"
        self.names.append(name)
        return name

    def to(self, fn: Any, compute: kt.Compute, name: str) -> Any:
        """``kt.fn(fn).to(compute, name=name)``, remembered for cleanup."""
        if name not in self.names:
            self.names.append(name)
        remote = kt.fn(fn).to(compute, name=name)
        self.remotes.append(remote)
        return remote

    def cleanup(self) -> None:
        problems = []
        for remote in reversed(self.remotes):
            try:
                remote.teardown(volumes=True)
            except Exception as e:  # noqa: BLE001
                problems.append(f"teardown of {remote!r}: {type(e).__name__}: {e}")
                with contextlib.suppress(Exception):
                    remote.deployment.close()
        for name in self.names:
            try:
                self.kube.delete_matching(f"{NAME_LABEL}={name}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"deleting {name}: {type(e).__name__}: {e}")
        self.remotes.clear()
        self.names.clear()
        if problems:
            print("\nktlite test cleanup: " + "; ".join(problems))


@pytest.fixture
def deployments(kube: Kube, run_prefix: str) -> Iterator[Deployments]:
    d = Deployments(kube, run_prefix)
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def module_deployments(kube: Kube, run_prefix: str) -> Iterator[Deployments]:
    d = Deployments(kube, run_prefix)
    try:
        yield d
    finally:
        d.cleanup()


# ---- computes --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def make_compute(settings: Settings) -> Callable[..., kt.Compute]:
    """``make_compute(image=None, workers=None, num_proc=1, **fields)``: a kubernetes Compute.

    Defaults: 500m CPU, 1Gi, the test image and pull policy, launch_timeout 300 s;
    ``workers=N`` gives ``.distribute("pytorch", workers=N, num_proc=num_proc)``.
    """

    def make(
        image: str | None = None, workers: int | None = None, num_proc: int = 1, **fields: Any
    ) -> kt.Compute:
        fields.setdefault("cpus", "500m")
        fields.setdefault("memory", "1Gi")
        fields.setdefault("launch_timeout", 300)
        fields.setdefault("image_pull_policy", settings.pull_policy)
        compute = kt.Compute(
            backend="kubernetes",
            namespace=settings.namespace,
            image=kt.Image(image or settings.image),
            **fields,
        )
        if workers is not None:
            compute = compute.distribute("pytorch", workers=workers, num_proc=num_proc)
        return compute

    return make


@pytest.fixture
def storage_class(settings: Settings, kube: Kube) -> str | None:
    """The StorageClass for the volume test (None: the cluster default); skips when none."""
    if settings.skip_volumes:
        pytest.skip("KTLITE_TEST_SKIP_VOLUMES is set")
    if settings.storage_class:
        return settings.storage_class
    if kube.has_default_storage_class() is False:
        pytest.skip(
            "the cluster has no default StorageClass; set KTLITE_TEST_STORAGE_CLASS "
            "(or KTLITE_TEST_SKIP_VOLUMES=1)"
        )
    return None
