"""Secrets against a real cluster (opt-in, like ``test_cluster.py``; settings in ``conftest.py``).

Kubetorch's form: ``Compute(secrets=["huggingface", kt.secret(provider="aws", path=...),
kt.secret(name="db", env_vars={...})])``. Every rank reads the env vars and files on its pod
(returning digests, never values); the Secrets ktlite made are labelled as the deployment's
and gone after teardown, and none of their values is in the printed plan.
"""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import pytest
import secret_funcs

import ktlite as kt

NAME_LABEL = "ktlite.dev/name"
SECRET_LABEL = "ktlite.dev/secret"

pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_kubetorch_form_secrets_reach_every_rank_as_env_and_files(
    deployments, make_compute, kube, tmp_path: Path, monkeypatch
) -> None:
    hf, db = f"hf_{secrets.token_hex(12)}", f"pw-{secrets.token_hex(12)}"
    credentials = f"[default]\naws_access_key_id = AKIA{secrets.token_hex(8)}\n".encode()
    (tmp_path / "aws").mkdir()
    (tmp_path / "aws" / "credentials").write_bytes(credentials)
    monkeypatch.setenv("HF_TOKEN", hf)
    compute = make_compute(
        workers=2,
        secrets=[
            "huggingface",
            kt.secret(provider="aws", path=str(tmp_path / "aws")),
            kt.secret(name="db", env_vars={"DB_PASSWORD": db}),
        ],
    )
    name = deployments.name("secrets")
    plan = kt.fn(secret_funcs.read_secrets).to(compute, name=name, dryrun=True)
    assert hf not in str(plan) and db not in str(plan) and credentials.decode() not in str(plan)

    remote = deployments.to(secret_funcs.read_secrets, compute, name)
    results = remote(["HF_TOKEN", "DB_PASSWORD"], ["~/.aws/credentials"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["env"] == {
            "HF_TOKEN": secret_funcs.digest(hf),
            "DB_PASSWORD": secret_funcs.digest(db),
        }, r
        file = r["files"]["~/.aws/credentials"]
        assert file.get("digest") == secret_funcs.digest(credentials), file
        # the item's 0400, plus the group read the kubelet adds for the pods' fsGroup (a Secret
        # file is root's: without it user 1000 could not read it); ~/.aws stays the user's
        assert file["mode"] == "0o440" and file["dir_writable"], file
        assert r["pointers"]["AWS_SHARED_CREDENTIALS_FILE"] == "/home/ktlite/.aws/credentials"

    selector = f"{NAME_LABEL}={name}"
    made = {
        s.metadata.name: s
        for s in kube.list("secrets", selector)
        if SECRET_LABEL in (s.metadata.labels or {})
    }
    assert sorted(made) == [f"{name}-secret-aws", f"{name}-secret-db", f"{name}-secret-huggingface"]
    assert base64.b64decode(made[f"{name}-secret-db"].data["DB_PASSWORD"]).decode() == db
    assert made[f"{name}-secret-db"].type == "Opaque"

    remote.teardown()
    left = kube.wait_gone(selector, ("secrets", "pods"), timeout=120)
    assert left == {}, f"still there 120 s after teardown(): {left}"
