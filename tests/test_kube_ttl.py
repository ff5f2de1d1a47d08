"""``inactivity_ttl`` on Kubernetes, against the fake API server (``kube_fake``, with RBAC
for ServiceAccount tokens: ``kube_rbac``): the objects that let a deployment delete itself
(strictly valid), what its ServiceAccount may and may not delete, what the backend makes and
removes, and the pod server's own teardown (``ktlite_server.selfteardown``) over real HTTP.
The stand-in cluster runs the whole of it: ``test_kube_ttl_e2e.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import kube_fake as kf
import kubernetes_validate
import pytest
from kube_cluster import Cluster as StandIn

import ktlite as kt
from ktlite.backends import kube_deps
from ktlite.backends import kube_expiry as kexp
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.commands import expiry_cli
from ktlite.errors import DeployError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_server.selfteardown import SelfTeardown, TeardownError

HOST = "https://fake-apiserver"
API_TOKEN = "api-admin-ttl"
TOKEN = "tok-ttl"
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
ACCESS = ("serviceaccounts", "roles", "rolebindings")


def spec(name: str = "idle", ttl: Any = "30m", **compute: Any) -> DeploymentSpec:
    return DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", inactivity_ttl=ttl, launch_timeout=60, **compute)
        .distribute(workers=2)
        .pod_spec(),
    )


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``), with this module's credential."""

    api_token = API_TOKEN

    def names(self, kind: str) -> list[str]:
        return [o["metadata"]["name"] for o in self.fake.objects(kind)]

    def as_account(self, name: str) -> httpx.Client:
        """A client with the token the kubelet would project for ServiceAccount ``name``."""
        token = self.fake.service_account_token("default", name)
        assert token is not None, f"no ServiceAccount {name}"
        return httpx.Client(
            transport=self.fake, base_url=HOST, headers={"authorization": f"Bearer {token}"}
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.http.close()


def _pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    pod: dict[str, Any] = sts["spec"]["template"]["spec"]
    return pod


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _pod(objects)["containers"][0]["env"]}


# ---- manifests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_a_ttl_gives_the_pods_an_account_that_may_delete_only_its_own_objects(
    version: str,
) -> None:
    objects = KubernetesBackend(namespace="team").plan(spec()).manifests
    kinds = [o["kind"] for o in objects]
    assert kinds.index("RoleBinding") < kinds.index("StatefulSet")  # made before the pods
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']} is not valid {version}: {e.message}", pytrace=False)
    account, role, binding = (next(o for o in objects if o["kind"] == k) for k in kexp.KINDS)
    assert account["metadata"]["name"] == role["metadata"]["name"] == "idle-ttl"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "idle-ttl", "namespace": "team"}
    ]
    rules = {(r["apiGroups"][0], r["resources"][0]): r for r in role["rules"]}
    assert all(r["resourceNames"] for r in role["rules"])  # by name, every one
    assert rules[("apps", "statefulsets")]["verbs"] == ["get", "delete"]
    assert rules[("apps", "statefulsets")]["resourceNames"] == ["idle"]
    assert rules[("", "secrets")] == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["delete"],
        "resourceNames": ["idle-token"],
    }
    assert rules[("", "serviceaccounts")]["resourceNames"] == ["idle-ttl"]
    assert all(set(r["verbs"]) <= {"get", "delete"} for r in role["rules"])
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    assert sts["metadata"]["annotations"][kexp.TTL_ANNOTATION] == "1800"
    pod = _pod(objects)
    assert pod["serviceAccountName"] == "idle-ttl"
    assert pod["automountServiceAccountToken"] is False  # the token is at ktlite's path only
    projected = next(v for v in pod["volumes"] if v["name"] == kexp.API_VOLUME)["projected"]
    token = projected["sources"][0]["serviceAccountToken"]
    assert token["expirationSeconds"] == 600 and projected["defaultMode"] == 0o400
    env = _env(objects)
    assert env["KTLITE_INACTIVITY_TTL"] == "1800"
    assert env["KTLITE_TEARDOWN_PATHS"].startswith(
        '["/apis/apps/v1/namespaces/{namespace}/statefulsets/idle"'
    )


def test_without_a_ttl_nothing_changes_and_with_the_users_account_the_pods_keep_it() -> None:
    plain = KubernetesBackend().plan(spec(ttl=None)).manifests
    assert not {o["kind"] for o in plain} & set(kexp.KINDS)
    assert "annotations" not in next(o for o in plain if o["kind"] == "StatefulSet")["metadata"]
    assert "KTLITE_INACTIVITY_TTL" not in _env(plain)
    assert "serviceAccountName" not in _pod(plain)
    own = KubernetesBackend().plan(spec(service_account="trainer")).manifests
    assert not {o["kind"] for o in own} & set(kexp.KINDS)
    assert _pod(own)["serviceAccountName"] == "trainer"
    assert "KTLITE_TEARDOWN_PATHS" not in _env(own)  # it cannot delete itself: swept instead
    assert _env(own)["KTLITE_INACTIVITY_TTL"] == "1800"


# ---- the account's rights, enforced by the fake's RBAC ----------------------------------------


def test_the_account_deletes_its_own_deployment_and_nothing_of_another(cluster: Cluster) -> None:
    cluster.backend.apply(spec("idle", secrets=[kt.secret(name="k", env_vars={"K": "v"})]), TOKEN)
    cluster.backend.apply(spec("other"), TOKEN)
    roles = {r["metadata"]["name"]: r for r in cluster.fake.objects("roles")}
    account = cluster.fake.get("serviceaccounts", "default", "idle-ttl")
    assert account is not None
    assert roles["idle-ttl"]["metadata"]["ownerReferences"][0]["uid"] == account["metadata"]["uid"]
    with cluster.as_account("idle-ttl") as pod:
        for path in (
            "/apis/apps/v1/namespaces/default/statefulsets/other",
            "/api/v1/namespaces/default/secrets/other-token",
            "/api/v1/namespaces/default/serviceaccounts/other-ttl",
        ):
            denied = pod.delete(path)
            assert denied.status_code == 403, path
            assert (
                'User "system:serviceaccount:default:idle-ttl" cannot delete'
                in denied.json()["message"]
            )
        assert pod.get("/api/v1/namespaces/default/secrets").status_code == 403  # no list
        assert pod.get("/api/v1/namespaces/default/secrets/idle-token").status_code == 403
        assert pod.get("/apis/apps/v1/namespaces/default/statefulsets/idle").status_code == 200
    env = _env([o for o in cluster.fake.objects("statefulsets") if o["metadata"]["name"] == "idle"])
    teardown = SelfTeardown(
        HOST, tuple(p.replace("{namespace}", "default") for p in kexp_paths(env))
    )
    deleted = _run_over_fake(cluster, teardown, "idle-ttl")
    assert deleted[0].endswith("/statefulsets/idle") and deleted[-1].endswith(
        "/serviceaccounts/idle-ttl"
    )
    for kind in ("statefulsets", "services", "secrets", "networkpolicies", *ACCESS):
        assert [n for n in cluster.names(kind) if n.startswith("idle")] == [], kind
    assert cluster.names("statefulsets") == ["other"]  # the other deployment is untouched
    assert "other-ttl" in cluster.names("roles")
    assert [p for p in cluster.names("pods") if p.startswith("idle")] == []  # collected


def kexp_paths(env: dict[str, str]) -> list[str]:
    import json

    paths: list[str] = json.loads(env["KTLITE_TEARDOWN_PATHS"])
    return paths


def _run_over_fake(cluster: Cluster, teardown: SelfTeardown, account: str) -> list[str]:
    """``teardown.run()`` with the account's token, over real HTTP to the fake."""
    token = cluster.fake.service_account_token("default", account)
    assert token is not None
    with _served(cluster.fake) as url, _token_file(token) as path:
        return SelfTeardown(url, teardown.paths, token_file=path).run()


class _served:
    """The fake API server on a loopback port (the pod's urllib speaks real HTTP)."""

    def __init__(self, fake: kf.FakeKube) -> None:
        class Bridge(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                resp = fake.handle_request(
                    httpx.Request(
                        self.command,
                        f"http://fake{self.path}",
                        headers=list(self.headers.items()),
                        content=self.rfile.read(n) if n else b"",
                    )
                )
                body = resp.read()
                self.send_response(resp.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Bridge)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class _token_file:
    def __init__(self, token: str) -> None:
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.path = f"{self.dir.name}/token"
        with open(self.path, "w") as f:
            f.write(token)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.dir.cleanup()


def test_once_the_account_is_deleted_its_token_is_refused(cluster: Cluster) -> None:
    cluster.backend.apply(spec("idle"), TOKEN)
    with cluster.as_account("idle-ttl") as pod:
        assert pod.delete("/api/v1/namespaces/default/serviceaccounts/idle-ttl").status_code == 200
        assert cluster.names("roles") == [] and cluster.names("rolebindings") == []  # collected
        assert pod.get("/apis/apps/v1/namespaces/default/statefulsets/idle").status_code == 401


def test_a_pod_whose_api_is_unreachable_says_so() -> None:
    teardown = SelfTeardown("http://127.0.0.1:9", ("/apis/apps/v1/namespaces/d/statefulsets/x",))
    with _token_file("t") as path, pytest.raises(TeardownError, match="could not be reached"):
        SelfTeardown(teardown.api, teardown.paths, token_file=path, timeout=2).run()


# ---- the backend ---------------------------------------------------------------------------------


def test_apply_makes_the_access_and_teardown_and_a_ttl_less_redeploy_remove_it(
    cluster: Cluster,
) -> None:
    cluster.backend.apply(spec("idle"), TOKEN)
    assert [cluster.names(k) for k in ACCESS] == [["idle-ttl"]] * 3
    rows = {r["name"]: r for r in cluster.backend.list()}
    assert rows["idle"]["ttl_s"] == 1800  # idle_s: None, no server answers in the fake
    assert expiry_cli.columns(rows["idle"]) == ("-", "ttl 30m00s")
    cluster.backend.apply(spec("idle", ttl=None), TOKEN)  # no TTL now: no account either
    assert [cluster.names(k) for k in ACCESS] == [[], [], []]
    cluster.backend.apply(spec("idle"), TOKEN)
    assert cluster.backend.teardown("idle") is True
    for kind in ("statefulsets", "services", "secrets", "networkpolicies", *ACCESS):
        left = [
            o["metadata"]["name"]
            for o in cluster.fake.objects(kind)
            if kube_deps.DEPS_LABEL not in (o["metadata"].get("labels") or {})
        ]
        assert left == [], kind  # the namespace's cache of the server's packages stays


def test_the_sweep_tears_down_what_expired_only() -> None:
    removed: list[str] = []

    class Backend:
        def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
            removed.append(name)
            return True

    rows = [
        {"name": "old", "idle_s": 61.0, "ttl_s": 60.0},
        {"name": "busy", "idle_s": 0.0, "ttl_s": 60.0},
        {"name": "unknown", "idle_s": None, "ttl_s": 60.0},
        {"name": "forever", "idle_s": 5000.0, "ttl_s": None},
    ]
    said: list[str] = []
    assert expiry_cli.sweep(Backend(), rows, dry_run=True, say=said.append) == ["old"]  # type: ignore[arg-type]
    assert removed == [] and said == ["old: would be torn down (idle 1m01s, inactivity_ttl 1m00s)"]
    assert expiry_cli.sweep(Backend(), rows, say=said.append) == ["old"]  # type: ignore[arg-type]
    assert removed == ["old"] and said[-1] == "old: torn down (idle 1m01s, inactivity_ttl 1m00s)"
    assert expiry_cli.columns(rows[1]) == ("0s", "in 1m00s")
    assert expiry_cli.columns(rows[0]) == ("1m01s", "expired")


def test_an_account_without_rights_on_service_accounts_deploys_without_a_ttl(
    cluster: Cluster,
) -> None:
    cluster.fake.fail_next("*", "/serviceaccounts", status=403, reason="Forbidden", times=10)
    cluster.backend.apply(spec("plain", ttl=None), TOKEN)  # never needs them
    assert cluster.names("statefulsets") == ["plain"]
    with pytest.raises(DeployError, match="verbs get, create, update, delete on serviceaccounts"):
        cluster.backend.apply(spec("idle"), TOKEN)
