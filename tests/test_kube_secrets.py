"""Secrets on the Kubernetes backend: the manifests (strictly valid, placeholders in plans), the
backend against the fake API server (``kube_fake.py``, fake clock: which Secrets it makes,
updates, adopts, leaves alone and deletes), and the cluster suite's secrets test run against
the stand-in cluster (``kube_harness.py``: real pod processes reading the env vars and files).
"""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kube_cluster import Cluster as StandIn

import ktlite as kt
from ktlite import config
from ktlite.backends import kube_deps, shipped_source
from ktlite.backends import kube_manifests as km
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.specs.deployment_spec import DeploymentSpec

HERE = Path(__file__).parent
HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-secrets"
TOKEN = "tok-deployment-1"
NAME = "job"
VALUE = "sk-KNOWN-" + uuid.uuid4().hex
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No cached clients, no user settings, an empty HOME and no provider variables."""
    monkeypatch.setattr(KubernetesBackend, "_announced", set())
    monkeypatch.setattr(KubernetesBackend, "_clients", {})
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "ktlite-home"))
    for env, _, _ in config.KEYS.values():
        monkeypatch.delenv(env, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "KUBECONFIG",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HOME",
        "HF_TOKEN_PATH",
        "OPENAI_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    return home


def put(rel: str, text: str) -> Path:
    path = Path(os.environ["HOME"]) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``), with this module's credential."""

    api_token = API_TOKEN

    def secrets(self) -> dict[str, dict[str, Any]]:
        """The Secrets there, but the namespace's shared cache of the server's packages."""
        return {
            o["metadata"]["name"]: o
            for o in self.fake.objects("secrets")
            if kube_deps.DEPS_LABEL not in (o["metadata"].get("labels") or {})
        }

    def deps(self) -> list[dict[str, Any]]:
        return [
            o
            for o in self.fake.objects("secrets")
            if kube_deps.DEPS_LABEL in (o["metadata"].get("labels") or {})
        ]

    def data(self, name: str) -> dict[str, str]:
        return {k: base64.b64decode(v).decode() for k, v in self.secrets()[name]["data"].items()}

    def uids(self) -> list[str]:
        return sorted(p["metadata"]["uid"] for p in self.fake.objects("pods"))


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.http.close()


def spec(*secrets: Any, name: str = NAME, **compute: Any) -> DeploymentSpec:
    return DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", secrets=list(secrets), launch_timeout=60, **compute)
        .distribute(workers=2)
        .pod_spec(),
    )


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    result: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return result


# ---- manifests ---------------------------------------------------------------------------------


def test_kubetorch_form_plan_is_valid_and_holds_placeholders_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put(".aws/credentials", f"[default]\naws_secret_access_key = {VALUE}\n")
    put(".aws/config", "[default]\n")
    put(".kube/config", f"token: {VALUE}\n")
    put(".ssh/id_ed25519", VALUE)
    put(".config/gcloud/application_default_credentials.json", f'{{"secret": "{VALUE}"}}')
    monkeypatch.setenv("HF_TOKEN", VALUE)
    compute = kt.Compute(
        backend="kubernetes",
        secrets=[
            "aws",
            "kubeconfig",
            "ssh",
            "gcp",
            "huggingface",
            "existing-one",
            kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE}),
        ],
    )
    plan = kt.fn(len).to(compute, name=NAME, dryrun=True)
    text = str(plan)
    assert VALUE not in text
    for obj in plan.manifests:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    made = {o["metadata"]["name"]: o for o in plan.manifests if o["kind"] == "Secret"}
    assert sorted(made) == sorted(
        [
            f"{NAME}-token",
            *(
                f"{NAME}-secret-{k}"
                for k in ("aws", "kubeconfig", "ssh", "gcp", "huggingface", "db")
            ),
        ]
    )
    aws = made[f"{NAME}-secret-aws"]
    size = len(f"[default]\naws_secret_access_key = {VALUE}\n")
    assert aws["stringData"]["credentials"] == f"<redacted: {size} bytes from ~/.aws/credentials>"
    assert (
        aws["metadata"]["labels"] == {**km.labels(NAME), km.SECRET_LABEL: "aws"}
        and aws["type"] == "Opaque"
    )
    assert made[f"{NAME}-secret-huggingface"]["stringData"] == {
        "HF_TOKEN": f"<redacted: {len(VALUE)} bytes from $HF_TOKEN>"
    }
    assert "existing-one" not in made  # reused, never made

    c = container(plan.manifests)
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{NAME}-secret-huggingface", "key": "HF_TOKEN"}
    }
    assert env["DB_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{NAME}-secret-db", "key": "DB_PASSWORD"}
    }
    assert env["AWS_SHARED_CREDENTIALS_FILE"]["value"] == "/home/ktlite/.aws/credentials"
    assert env["AWS_CONFIG_FILE"]["value"] == "/home/ktlite/.aws/config"
    assert env["KUBECONFIG"]["value"] == "/home/ktlite/.kube/config"
    assert (
        env["GOOGLE_APPLICATION_CREDENTIALS"]["value"]
        == "/home/ktlite/.config/gcloud/application_default_credentials.json"
    )
    assert c["envFrom"] == [{"secretRef": {"name": "existing-one"}}]
    # each file secret's volume in a directory of ktlite's; its files linked to from the home
    # at start (the directories there stay the user's: ~/.ssh/known_hosts can be written)
    links = dict(line.split("=", 1) for line in env["KTLITE_SECRET_LINKS"]["value"].splitlines())
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    aws_dir, _, aws_key = links["/home/ktlite/.aws/credentials"].rpartition("/")
    assert aws_key == "credentials" and mounts[aws_dir]["readOnly"]
    assert aws_dir.startswith("/var/run/ktlite/secrets/") and "subPath" not in mounts[aws_dir]
    assert links["/home/ktlite/.ssh/id_ed25519"].endswith("/id_ed25519")
    assert not [p for p in mounts if p.startswith("/home/ktlite/")]
    sts = next(o for o in plan.manifests if o["kind"] == "StatefulSet")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    aws_volume = volumes[mounts[aws_dir]["name"]]["secret"]
    assert aws_volume["secretName"] == f"{NAME}-secret-aws" and aws_volume["defaultMode"] == 0o400
    assert aws_volume["items"] == [
        {"key": "credentials", "path": "credentials", "mode": 0o400},
        {"key": "config", "path": "config", "mode": 0o400},
    ]
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations[km.SECRETS_ANNOTATION] == km.TOKEN_PLACEHOLDER


def test_render_with_a_token_holds_the_values_and_a_keyed_digest() -> None:
    s = spec(kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE}))
    objects = km.render(s, "default", image="img", install="ktlite", token=TOKEN)
    for obj in objects:
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)
    db = next(o for o in objects if o["metadata"]["name"] == f"{NAME}-secret-db")
    assert base64.b64decode(db["data"]["DB_PASSWORD"]).decode() == VALUE
    digest = (
        container(objects)
        and next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]["metadata"][
            "annotations"
        ][km.SECRETS_ANNOTATION]
    )
    other = km.render(
        spec(kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE + "x"})),
        "default",
        image="img",
        install="ktlite",
        token=TOKEN,
    )
    assert (
        digest
        != next(o for o in other if o["kind"] == "StatefulSet")["spec"]["template"]["metadata"][
            "annotations"
        ][km.SECRETS_ANNOTATION]
    )
    assert VALUE not in digest and len(digest) == 16


def test_a_secret_of_another_namespace_is_refused() -> None:
    with pytest.raises(kt.ConfigError, match="own namespace"):
        km.render(
            spec(kt.secret(name="db", env_vars={"A": "1"}, namespace="other")),
            "default",
            image="img",
            install="ktlite",
        )


# ---- the backend against the fake API server -----------------------------------------------------


def test_apply_makes_labelled_secrets_and_teardown_deletes_only_those(cluster: Cluster) -> None:
    put(".aws/credentials", "[default]\nkey = 1\n")
    cluster.fake.create(
        "secrets",
        "default",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "shared"},
            "stringData": {"TEAM_TOKEN": "t"},
        },
    )
    cluster.backend.apply(
        spec("aws", "shared", kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})), TOKEN
    )
    assert sorted(cluster.secrets()) == [
        f"{NAME}-secret-aws",
        f"{NAME}-secret-db",
        f"{NAME}-token",
        "shared",
    ]
    assert cluster.data(f"{NAME}-secret-db") == {"DB_PASSWORD": VALUE}
    assert cluster.data(f"{NAME}-secret-aws") == {"credentials": "[default]\nkey = 1\n"}
    assert cluster.secrets()[f"{NAME}-secret-db"]["metadata"]["labels"][km.NAME_LABEL] == NAME
    assert VALUE not in cluster.out.getvalue()

    assert cluster.backend.teardown(NAME, timeout=30)
    assert sorted(cluster.secrets()) == ["shared"], "the user's own Secret stays"


def test_an_unchanged_redeploy_writes_nothing_and_a_changed_value_rolls_the_pods(
    cluster: Cluster,
) -> None:
    cluster.backend.apply(spec(kt.secret(name="db", env_vars={"DB_PASSWORD": "one"})), TOKEN)
    uids, since = cluster.uids(), len(cluster.fake.requests)
    cluster.backend.apply(spec(kt.secret(name="db", env_vars={"DB_PASSWORD": "one"})), TOKEN)
    assert cluster.writes(since) == [] and cluster.uids() == uids

    applied = cluster.backend.apply(
        spec(kt.secret(name="db", env_vars={"DB_PASSWORD": "two"})), TOKEN
    )
    assert cluster.data(f"{NAME}-secret-db") == {"DB_PASSWORD": "two"}
    assert ("PUT", f"/api/v1/namespaces/default/secrets/{NAME}-secret-db") in cluster.writes(since)
    assert sorted(applied.restarted) == [0, 1] and not set(cluster.uids()) & set(uids)


def test_a_secret_no_longer_named_is_deleted_on_redeploy(cluster: Cluster) -> None:
    cluster.backend.apply(
        spec(kt.secret(name="a", env_vars={"A": "1"}), kt.secret(name="b", env_vars={"B": "2"})),
        TOKEN,
    )
    cluster.backend.apply(spec(kt.secret(name="a", env_vars={"A": "1"})), TOKEN)
    assert sorted(cluster.secrets()) == [f"{NAME}-secret-a", f"{NAME}-token"]


def test_a_foreign_secret_of_that_name_needs_override(cluster: Cluster) -> None:
    cluster.fake.create(
        "secrets",
        "default",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{NAME}-secret-db"},
            "stringData": {"DB_PASSWORD": "theirs"},
        },
    )
    since = len(cluster.fake.requests)
    with pytest.raises(kt.ConfigError, match="override=True"):
        cluster.backend.apply(spec(kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})), TOKEN)
    assert cluster.writes(since) == [], "nothing is made before the clash is found"
    cluster.backend.apply(
        spec(kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE}, override=True)), TOKEN
    )
    assert cluster.data(f"{NAME}-secret-db") == {"DB_PASSWORD": VALUE}
    assert cluster.secrets()[f"{NAME}-secret-db"]["metadata"]["labels"][km.NAME_LABEL] == NAME


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ("not-there", "does not exist in namespace 'default'"),
        ("aws", "provider 'aws' found nothing"),
    ],
)
def test_refused_before_anything_is_made(cluster: Cluster, secret: str, message: str) -> None:
    with pytest.raises(kt.ConfigError, match=message):
        cluster.backend.apply(spec(secret), TOKEN)
    assert cluster.writes() == []


# ---- the cluster suite's secrets test, against the stand-in cluster ------------------------------

# tests/kubernetes/test_secrets_cluster.py runs against the stand-in cluster with the rest of the
# cluster suite: tests/kube_e2e.py


def test_the_server_packages_are_shipped_once_per_namespace_and_outlive_a_deployment(
    cluster: Cluster,
) -> None:
    """The ktlite-deps Secrets: made by the first deploy (each under a Secret's 1 MiB, then the
    marker with the copy's digest), mounted by every pod, not made again (nor read: no part's
    megabyte) by the next deploy, left by teardown as the namespace's cache."""
    cluster.backend.apply(spec(name="one"), "tok-1")
    parts = cluster.deps()
    assert len(parts) == len(kube_deps._parts()) + 1 >= 3
    for part in parts:
        raw = {k: base64.b64decode(v) for k, v in part["data"].items()}
        assert len(b"".join(raw.values())) <= 1 << 20
        assert part["metadata"]["labels"][kube_deps.DEPS_LABEL] == kube_deps.key()
    marker = next(p for p in parts if p["metadata"]["name"] == kube_deps.marker_name())
    assert base64.b64decode(marker["data"]["digest"]).decode() == shipped_source.deps_digest()
    pod = cluster.fake.objects("statefulsets")[0]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == kube_deps.DEPS_VOLUME]
    names = [s["secret"]["name"] for s in volume["projected"]["sources"]]
    assert names == [
        kube_deps.marker_name(),
        *(kube_deps.secret_name(i) for i in range(kube_deps.MAX_PARTS)),
    ]
    assert all(s["secret"]["optional"] for s in volume["projected"]["sources"])
    since = len(cluster.fake.requests)
    cluster.backend.apply(spec(name="two"), "tok-2")
    made = [p for m, p in cluster.writes(since) if m == "POST" and p.endswith("/secrets")]
    assert len(made) == 1  # its token Secret only
    reads = [r for r in cluster.fake.requests[since:] if r.method == "GET"]
    assert [r.path.rsplit("/", 1)[1] for r in reads if "/secrets/ktlite-deps" in r.path] == [
        kube_deps.marker_name()
    ]
    assert not [r for r in reads if kube_deps.DEPS_LABEL in r.query.get("labelSelector", "")]
    cluster.backend.teardown("one")
    cluster.backend.teardown("two")
    assert len(cluster.deps()) == len(parts)
