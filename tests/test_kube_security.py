"""What every pod ktlite makes on Kubernetes gets for its safety (pure: no cluster).

Every kind of pod (a deployment's, each StatefulSet of a Ray cluster, Monarch's, a served
replica in both forms, the data store's) runs as a non-root user with nothing to escalate to
and no service-account token, reads the deployment token from a Secret file (never an env
var), and every deployment has a NetworkPolicy. ``run_as_user=0`` is the way back to root.
What user code on a pod sees of this is checked on the stand-in cluster and on a real one
(``tests/kubernetes/test_cluster.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

import ktlite
import ktlite as kt
from ktlite import config
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_serving as kss
from ktlite.backends import kube_store as ks
from ktlite.errors import ConfigError
from ktlite.specs.deployment_spec import DeploymentSpec

NAME = "sec"
TOKEN = "tok-n0t-in-the-env-6a1f"
NON_ROOT = {
    "seccompProfile": {"type": "RuntimeDefault"},
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "fsGroupChangePolicy": "OnRootMismatch",
}
NO_PRIVILEGES = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.fixture(autouse=True)
def _clean_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "ktlite-home"))
    for env, _, _ in config.KEYS.values():
        monkeypatch.delenv(env, raising=False)
    monkeypatch.delenv("KTLITE_STORE_RUN_AS_USER", raising=False)


def K(**kwargs: Any) -> kt.Compute:
    return kt.Compute(backend="kubernetes", **kwargs)


def _spec(compute: kt.Compute) -> DeploymentSpec:
    return DeploymentSpec(NAME, compute.pod_spec())


def _render(compute: kt.Compute) -> list[dict[str, Any]]:
    return km.render(_spec(compute), "default", image="img:1", install="ktlite==0.0.0", token=TOKEN)


def _served(caps: kss.Capabilities, **compute: Any) -> list[dict[str, Any]]:
    spec = DeploymentSpec(
        NAME, K(launch_timeout=60, **compute).autoscale(min_scale=1, max_scale=3).pod_spec()
    )
    return kss.render(
        spec, "default", image="img:1", install="ktlite==0.0.0", caps=caps, token=TOKEN
    )


def _pod_specs(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod spec among ``objs`` (StatefulSets, Deployments, Knative Services)."""
    return [
        o["spec"]["template"]["spec"]
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment")
        or (o["kind"] == "Service" and o["apiVersion"].startswith("serving.knative"))
    ]


EVERY_KIND = {
    "plain": lambda: _render(K(cpus=1)),
    "pytorch": lambda: _render(K(cpus=1).distribute("pytorch", workers=2, num_proc=2)),
    "uneven-gpus": lambda: _render(K(gpus=1).distribute("pytorch", num_proc=[2, 4])),
    "ray": lambda: _render(K(cpus=1).distribute("ray", workers=3, worker_node_options={"cpus": 2})),
    "monarch": lambda: _render(K(cpus=1).distribute("monarch", workers=2)),
    "served-hpa": lambda: _served(kss.Capabilities(), cpus=1),
    "served-knative": lambda: _served(kss.Capabilities(knative=True), cpus=1),
    "store": lambda: ks.render("default", image="img:1", install="ktlite==0.0.0", token=TOKEN),
}


@pytest.mark.parametrize("kind", list(EVERY_KIND))
def test_every_pod_runs_as_a_non_root_user_with_nothing_to_escalate_to(kind: str) -> None:
    pods = _pod_specs(EVERY_KIND[kind]())
    assert pods
    for pod in pods:
        assert pod["securityContext"] == NON_ROOT
        assert pod["automountServiceAccountToken"] is False
        (container,) = pod["containers"]
        assert container["securityContext"] == NO_PRIVILEGES
        env = {e["name"]: e for e in container["env"]}
        assert env["HOME"] == {"name": "HOME", "value": "/home/ktlite"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["ktlite-home"] == {"name": "ktlite-home", "emptyDir": {}}


@pytest.mark.parametrize("kind", list(EVERY_KIND))
def test_every_pod_reads_its_token_from_a_secret_file_never_from_an_env_var(kind: str) -> None:
    for pod in _pod_specs(EVERY_KIND[kind]()):
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert "KTLITE_TOKEN" not in env
        assert not [e for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
        assert env["KTLITE_TOKEN_FILE"]["value"] == "/var/run/ktlite/token/token"
        token = {v["name"]: v for v in pod["volumes"]}["ktlite-token"]["secret"]
        # beside the token, the deployment's TLS certificate and key (docs/tls.md), where the
        # pods serve TLS: not the store's, not an autoscaled deployment's replicas
        tls = not kind.startswith("served") and kind != "store"
        assert token["defaultMode"] == 0o400 and token["items"] == [
            {"key": "token", "path": "token"},
            *(
                [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
                if tls
                else []
            ),
        ]
        assert token["secretName"] == ("ktlite-store-token" if kind == "store" else f"{NAME}-token")
        mount = {m["name"]: m for m in container["volumeMounts"]}["ktlite-token"]
        assert mount == {
            "name": "ktlite-token",
            "mountPath": "/var/run/ktlite/token",
            "readOnly": True,
        }


@pytest.mark.parametrize("kind", [k for k in EVERY_KIND if k != "store"])
def test_every_deployment_has_a_network_policy_that_opens_only_the_server_port(kind: str) -> None:
    objs = EVERY_KIND[kind]()
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    kubernetes_validate.validate(policy, kubernetes_validate.utils.latest_version(), strict=True)
    own = {"matchLabels": {km.NAME_LABEL: NAME}}
    assert policy["spec"]["podSelector"] == own
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_to_all, own_pods = policy["spec"]["ingress"]
    ports = [p["port"] for p in open_to_all["ports"]]
    assert "from" not in open_to_all and ports[0] == km.SERVER_PORT
    # Knative's activator and autoscaler reach the replica's queue-proxy; nothing else is open
    assert ports[1:] == (list(kss.KNATIVE_QUEUE_PORTS) if kind == "served-knative" else [])
    assert own_pods == {"from": [{"podSelector": own}]}
    # applied before any pod exists
    pods = [i for i, o in enumerate(objs) if (o.get("spec") or {}).get("template")]
    assert objs.index(policy) < min(pods)


def test_run_as_user_0_runs_the_pods_as_root_with_the_runtimes_capabilities() -> None:
    for objs in (
        _render(K(cpus=1, run_as_user=0)),
        _served(kss.Capabilities(), cpus=1, run_as_user=0),
    ):
        for pod in _pod_specs(objs):
            assert pod["securityContext"] == {
                "seccompProfile": {"type": "RuntimeDefault"},
                "runAsUser": 0,
                "runAsGroup": 0,
            }
            assert "securityContext" not in pod["containers"][0]
    store = ks.render("default", image="img:1", install="ktlite==0.0.0", token=None, run_as_user=0)
    assert _pod_specs(store)[0]["securityContext"]["runAsUser"] == 0


def test_another_user_id_is_used_for_user_group_and_fs_group() -> None:
    (pod,) = _pod_specs(_render(K(run_as_user=65532)))
    context = pod["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (65532,) * 3


def test_the_store_pods_user_comes_from_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ks.store_user() == 1000
    monkeypatch.setenv("KTLITE_STORE_RUN_AS_USER", "0")
    assert ks.store_user() == 0
    monkeypatch.setenv("KTLITE_STORE_RUN_AS_USER", "root")
    with pytest.raises(ConfigError, match=r"KTLITE_STORE_RUN_AS_USER='root' must be a user id"):
        ks.store_user()


@pytest.mark.parametrize("bad", [-1, 2**31, "1000", 1.5, True])
def test_run_as_user_is_checked_at_construction(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"run_as_user=.* must be a user id from 0 to"):
        K(run_as_user=bad)


def test_a_named_service_account_keeps_its_token_mounted() -> None:
    (pod,) = _pod_specs(_render(K(service_account="trainer")))
    assert pod["serviceAccountName"] == "trainer"
    assert "automountServiceAccountToken" not in pod  # the code means to use it
    assert pod["securityContext"] == NON_ROOT


def test_the_computes_home_wins_over_ktlites() -> None:
    (pod,) = _pod_specs(_render(K(env={"HOME": "/data/home"})))
    homes = [e for e in pod["containers"][0]["env"] if e["name"] == "HOME"]
    assert homes == [{"name": "HOME", "value": "/data/home"}]


def test_run_as_user_is_a_pod_field_that_replaces_the_pods() -> None:
    def pod_hash(compute: kt.Compute) -> str:
        sts = next(o for o in _render(compute) if o["kind"] == "StatefulSet")
        value: str = sts["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION]
        return value

    assert pod_hash(K(cpus=1)) != pod_hash(K(cpus=1, run_as_user=0))
    assert ktlite.Compute(run_as_user=0).run_as_user == 0  # the flat name reads it back
