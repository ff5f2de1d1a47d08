"""Secrets: ``kt.secret`` / ``kt.Secret`` / ``Compute(secrets=[...])``, the provider presets (read
from a temporary HOME and environment), and the local backend with real rank processes that
read the env vars and files on their "pod". The last test deploys with a known value and
searches every place ktlite writes or prints (reprs, plans, errors, state.json, pod logs,
the caller's output) for it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.specs import secret_providers
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.secrets import Resolved, resolve

VALUE = "sk-KNOWN-9f3b2c7e51d84a06b1c2d3e4f5a6b7c8"  # a secret value searched for wherever ktlite writes (fixed: it is in test ids, which xdist workers must agree on)
# every variable a preset reads: cleared so the developer's own credentials never leak in
PROVIDER_ENV = sorted(
    {
        *(n for p in secret_providers.TOKENS.values() for n in p.env),
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "KUBECONFIG",
        "HF_HOME",
        "HF_TOKEN_PATH",
        "NETRC",
        "AZURE_CLIENT_ID",
        "AZURE_CLIENT_SECRET",
        "AZURE_TENANT_ID",
        "AZURE_SUBSCRIPTION_ID",
    }
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME and no provider variables."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for name in PROVIDER_ENV:
        monkeypatch.delenv(name, raising=False)
    return h


def put(home: Path, rel: str, text: str) -> Path:
    path = home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def one(secret: kt.Secret | str) -> Resolved:
    return resolve(kt.Compute(secrets=[secret]).secrets)[0]


# ---- the Kubetorch form ----------------------------------------------------------------------


def test_kubetorch_form_secret_factory_makes_the_class() -> None:
    s = kt.secret(provider="aws")
    assert isinstance(s, kt.Secret) and s == kt.Secret(provider="aws")
    assert s.key == "aws" and not s.existing
    assert kt.secret(name="my-existing").existing
    assert kt.Compute(secrets=["aws"]).secrets == (kt.Secret(provider="aws"),)
    assert kt.Compute(secrets=["my-existing"]).secrets == (kt.Secret(name="my-existing"),)
    assert kt.secret("aws") == kt.secret(provider="aws")  # a preset's name alone is the preset
    assert kt.secret(name="aws", env_vars=["A"]).provider is None  # values of your own, called aws
    assert kt.Compute(secrets=None).secrets == ()


def test_kubetorch_form_compute_secrets_reads_nothing_until_deploy(home: Path) -> None:
    # a Compute is built at import (decorators, on pods too): it must not look for files
    compute = kt.Compute(secrets=["aws", "gcp", kt.secret(provider="ssh")])
    with pytest.raises(kt.ConfigError, match="provider 'aws'"):
        resolve(compute.secrets)


def test_reprs_name_keys_never_values() -> None:
    s = kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})
    compute = kt.Compute(secrets=[s])
    for text in (repr(s), str(s), repr(compute), repr(compute.pod_spec().shape()), repr(one(s))):
        assert VALUE not in text, text
    assert repr(s) == "Secret(name='db', env_vars=['DB_PASSWORD'])"
    assert "DB_PASSWORD" in repr(one(s))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: kt.Compute(secrets=["aws", "aws"]), "more than once"),
        (lambda: kt.Compute(secrets=[kt.secret(provider="aws"), "aws"]), "more than once"),
        (lambda: kt.Compute(secrets=[kt.secret(name="x", env_vars=["A"]), "x"]), "more than once"),
        (lambda: kt.Compute(secrets="aws"), "must be a list"),
        (lambda: kt.Compute(secrets=[42]), "of type int"),
        (lambda: kt.Compute(secrets=["Not_A_Name"]), "neither a provider preset"),
        (lambda: kt.secret(provider="nope"), "not a known provider"),
        (lambda: kt.secret(), "needs provider="),
        (lambda: kt.secret(name="Bad Name", env_vars=["A"]), "not a valid Secret name"),
        (lambda: kt.secret(name="x", env_vars=["1BAD"]), "env var names"),
        (lambda: kt.secret(name="x", env_vars="A"), "list of env var names"),
        (lambda: kt.secret(name="x", env_vars={"A": 1}), "must be strings"),
        (lambda: kt.secret(name="x", env_vars=["A"], path="~/f"), "not both"),
        (lambda: kt.secret(provider="aws", override="yes"), "True or False"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_fix(make, message: str) -> None:
    with pytest.raises(kt.ConfigError, match=message):
        make()


def test_a_bad_value_is_never_quoted_in_the_error() -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.secret(name="x", env_vars={"A": VALUE, "B": 3})
    assert VALUE not in str(info.value) and "'B'" in str(info.value)


# ---- presets, read from HOME and the environment -----------------------------------------------


def test_aws_reads_credentials_and_config_files(home: Path) -> None:
    put(home, ".aws/credentials", f"[default]\naws_secret_access_key = {VALUE}\n")
    put(home, ".aws/config", "[default]\nregion = eu-west-1\n")
    r = one("aws")
    assert not r.env
    assert [(f.key, f.pod_path, f.pointer) for f in r.files] == [
        ("credentials", ".aws/credentials", "AWS_SHARED_CREDENTIALS_FILE"),
        ("config", ".aws/config", "AWS_CONFIG_FILE"),
    ]
    assert VALUE.encode() in r.data()["credentials"]
    size = len((home / ".aws/credentials").read_bytes())
    assert r.placeholders()["credentials"] == f"<redacted: {size} bytes from ~/.aws/credentials>"


def test_aws_falls_back_to_the_key_env_vars(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", VALUE)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    r = one(kt.secret(provider="aws"))
    assert (
        r.env
        == {
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": VALUE,
            "AWS_DEFAULT_REGION": "us-east-2",
        }
        and not r.files
    )
    assert (
        r.placeholders()["AWS_SECRET_ACCESS_KEY"]
        == f"<redacted: {len(VALUE)} bytes from $AWS_SECRET_ACCESS_KEY>"
    )


def test_aws_path_picks_another_directory(home: Path, tmp_path: Path) -> None:
    put(tmp_path, "other/credentials", "[p]\n")
    r = one(kt.secret(provider="aws", path=str(tmp_path / "other")))
    assert [f.key for f in r.files] == ["credentials"]


def test_gcp_reads_adc_or_google_application_credentials(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    put(home, ".config/gcloud/application_default_credentials.json", '{"type": "authorized_user"}')
    r = one("gcp")
    (f,) = r.files
    assert (f.pod_path, f.pointer) == (
        ".config/gcloud/application_default_credentials.json",
        "GOOGLE_APPLICATION_CREDENTIALS",
    )
    key = put(tmp_path, "sa.json", '{"type": "service_account"}')
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    assert b"service_account" in one("gcp").files[0].data


@pytest.mark.parametrize(
    ("provider", "env", "exposed"),
    [
        ("huggingface", "HF_TOKEN", ["HF_TOKEN"]),
        ("huggingface", "HUGGING_FACE_HUB_TOKEN", ["HF_TOKEN"]),
        ("wandb", "WANDB_API_KEY", ["WANDB_API_KEY"]),
        ("openai", "OPENAI_API_KEY", ["OPENAI_API_KEY"]),
        ("anthropic", "ANTHROPIC_API_KEY", ["ANTHROPIC_API_KEY"]),
        ("github", "GH_TOKEN", ["GITHUB_TOKEN", "GH_TOKEN"]),
        ("cohere", "CO_API_KEY", ["COHERE_API_KEY", "CO_API_KEY"]),
        ("pinecone", "PINECONE_API_KEY", ["PINECONE_API_KEY"]),
        ("langchain", "LANGCHAIN_API_KEY", ["LANGCHAIN_API_KEY", "LANGSMITH_API_KEY"]),
        ("lambda", "LAMBDA_API_KEY", ["LAMBDA_API_KEY"]),
    ],
)
def test_token_presets_read_their_env_var(
    home: Path, monkeypatch: pytest.MonkeyPatch, provider: str, env: str, exposed: list[str]
) -> None:
    monkeypatch.setenv(env, VALUE)
    r = one(provider)
    assert r.env == dict.fromkeys(exposed, VALUE) and not r.files
    assert r.placeholders()[exposed[0]] == f"<redacted: {len(VALUE)} bytes from ${env}>"


@pytest.mark.parametrize(
    ("provider", "rel", "text", "exposed"),
    [
        ("huggingface", ".cache/huggingface/token", f"{VALUE}\n", "HF_TOKEN"),
        (
            "wandb",
            ".netrc",
            f"machine github.com login x password y\nmachine api.wandb.ai\n  login user\n"
            f"  password {VALUE}\n",
            "WANDB_API_KEY",
        ),
        ("lambda", ".lambda_cloud/lambda_keys", f"api_key = {VALUE}\n", "LAMBDA_API_KEY"),
    ],
)
def test_token_presets_read_their_usual_file(
    home: Path, provider: str, rel: str, text: str, exposed: str
) -> None:
    put(home, rel, text)
    r = one(provider)
    assert r.env == {exposed: VALUE}
    assert r.placeholders()[exposed] == f"<redacted: {len(VALUE)} bytes from ~/{rel}>"


def test_a_broken_netrc_is_reported_without_its_lines(home: Path) -> None:
    put(home, ".netrc", f"machine api.wandb.ai login user password\n{VALUE} bogus\n")
    with pytest.raises(kt.ConfigError, match="not a valid netrc") as info:
        one("wandb")
    assert VALUE not in str(info.value)


def test_ssh_takes_the_first_default_key_or_path(home: Path) -> None:
    put(home, ".ssh/id_rsa", "RSA KEY")
    put(home, ".ssh/id_ed25519", "ED KEY")
    put(home, ".ssh/id_ed25519.pub", "ssh-ed25519 AAAA")
    r = one("ssh")
    assert [(f.key, f.pod_path, oct(f.mode)) for f in r.files] == [
        ("id_ed25519", ".ssh/id_ed25519", "0o400"),
        ("id_ed25519.pub", ".ssh/id_ed25519.pub", "0o444"),
    ]
    r = one(kt.secret(provider="ssh", path="~/.ssh/id_rsa"))
    assert [f.key for f in r.files] == ["id_rsa"] and r.files[0].data == b"RSA KEY"


def test_kubeconfig_reads_kubeconfig_env_first(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    put(home, ".kube/config", "home-config")
    assert one("kubeconfig").files[0].data == b"home-config"
    other = put(tmp_path, "kc", "env-config")
    monkeypatch.setenv("KUBECONFIG", f"{other}{os.pathsep}/nowhere")
    (f,) = one("kubeconfig").files
    assert (f.data, f.pod_path, f.pointer) == (b"env-config", ".kube/config", "KUBECONFIG")


def test_azure_needs_a_service_principal(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID"):
        monkeypatch.setenv(name, f"{name}-value")
    assert sorted(one("azure").env) == ["AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID"]


@pytest.mark.parametrize(
    ("provider", "looked", "fix"),
    [
        ("aws", "~/.aws/credentials, $AWS_ACCESS_KEY_ID + $AWS_SECRET_ACCESS_KEY", "aws configure"),
        (
            "gcp",
            "~/.config/gcloud/application_default_credentials.json",
            "gcloud auth application-default login",
        ),
        (
            "huggingface",
            "$HF_TOKEN, $HUGGING_FACE_HUB_TOKEN, ~/.cache/huggingface/token",
            "huggingface-cli login",
        ),
        ("wandb", "$WANDB_API_KEY, ~/.netrc", "wandb login"),
        ("openai", "$OPENAI_API_KEY", "export OPENAI_API_KEY"),
        ("anthropic", "$ANTHROPIC_API_KEY", "export ANTHROPIC_API_KEY"),
        ("github", "$GITHUB_TOKEN, $GH_TOKEN", "export GITHUB_TOKEN"),
        ("ssh", "~/.ssh/id_ed25519, ~/.ssh/id_ecdsa, ~/.ssh/id_rsa", "ssh-keygen"),
        ("kubeconfig", "~/.kube/config", "set KUBECONFIG"),
        ("azure", "$AZURE_CLIENT_ID", "service principal"),
    ],
)
def test_a_preset_that_finds_nothing_names_the_places_and_the_fix(
    home: Path, provider: str, looked: str, fix: str
) -> None:
    (home / ".ssh").mkdir()
    with pytest.raises(kt.ConfigError) as info:
        one(provider)
    text = str(info.value)
    assert f"provider {provider!r}" in text and looked in text and fix in text, text


# ---- values of your own, and clashes -----------------------------------------------------------


def test_env_vars_list_reads_this_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DB_PASSWORD", VALUE)
    assert one(kt.secret(name="db", env_vars=["DB_PASSWORD"])).env == {"DB_PASSWORD": VALUE}
    with pytest.raises(kt.ConfigError, match="DB_USER are not set"):
        one(kt.secret(name="db", env_vars=["DB_PASSWORD", "DB_USER"]))


def test_provider_with_env_vars_takes_those_instead(home: Path) -> None:
    r = one(kt.secret(provider="openai", env_vars={"OPENAI_API_KEY": VALUE}))
    assert r.env == {"OPENAI_API_KEY": VALUE}
    assert r.placeholders()["OPENAI_API_KEY"] == f"<redacted: {len(VALUE)} bytes from env_vars=>"


def test_a_file_of_your_own_goes_to_the_same_place_under_the_home(
    home: Path, tmp_path: Path
) -> None:
    put(home, ".config/tool/creds.json", "{}")
    (f,) = one(kt.secret(name="tool", path="~/.config/tool/creds.json")).files
    assert (f.key, f.pod_path) == ("creds.json", ".config/tool/creds.json")
    put(tmp_path, "outside.json", "{}")
    with pytest.raises(kt.ConfigError, match="not under your home"):
        one(kt.secret(name="tool", path=str(tmp_path / "outside.json")))


def test_secrets_clash_with_each_other_env_and_ktlite(home: Path) -> None:
    a = kt.secret(name="a", env_vars={"TOKEN": "1"})
    b = kt.secret(name="b", env_vars={"TOKEN": "2"})
    with pytest.raises(kt.ConfigError, match="'a' and 'b' both set env var TOKEN"):
        resolve(kt.Compute(secrets=[a, b]).secrets)
    compute = kt.Compute(env={"TOKEN": "x"}, secrets=[a])
    with pytest.raises(kt.ConfigError, match="both set TOKEN"):
        resolve(compute.secrets, compute.env)
    with pytest.raises(kt.ConfigError, match="which ktlite sets itself"):
        resolve(
            kt.Compute(secrets=[kt.secret(name="r", env_vars={"RANK": "1"})]).secrets, {}, ("RANK",)
        )


# ---- the local backend: real pods and ranks ----------------------------------------------------


def read_on_rank(env_names: list[str], files: list[str]) -> dict[str, object]:
    """Digests of env vars and files as a rank sees them (never the values)."""
    import hashlib
    import os
    import stat

    out: dict[str, object] = {"rank": int(os.environ["RANK"]), "env": {}, "files": {}}
    for name in env_names:
        value = os.environ.get(name)
        out["env"][name] = None if value is None else hashlib.sha256(value.encode()).hexdigest()
    for var in files:
        path = os.environ.get(var)
        if path is None:
            out["files"][var] = None
            continue
        with open(path, "rb") as f:
            out["files"][var] = {
                "path": path,
                "digest": hashlib.sha256(f.read()).hexdigest(),
                "mode": oct(stat.S_IMODE(os.stat(path).st_mode)),
            }
    return out


def test_kubetorch_form_local_ranks_get_env_and_file_secrets(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = put(
        home, ".aws/credentials", f"[default]\naws_secret_access_key = {VALUE}\n"
    ).read_bytes()
    put(home, ".kube/config", "apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv("HF_TOKEN", "hf_" + VALUE)
    compute = kt.Compute(
        secrets=[
            "aws",
            "kubeconfig",
            kt.secret(provider="huggingface"),
            kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE}),
        ],
        launch_timeout=120,
    ).distribute("spmd", workers=2, num_proc=1)
    name = unique("secrets-local")
    remote = kt.fn(read_on_rank).to(compute, name=name)
    try:
        results = remote(["DB_PASSWORD", "HF_TOKEN"], ["AWS_SHARED_CREDENTIALS_FILE", "KUBECONFIG"])
        state_dir = Path(os.environ["KTLITE_HOME"]) / "local" / name
        for r in results:
            assert r["env"] == {"DB_PASSWORD": digest(VALUE), "HF_TOKEN": digest("hf_" + VALUE)}, r
            aws = r["files"]["AWS_SHARED_CREDENTIALS_FILE"]
            assert aws["digest"] == digest(credentials) and aws["mode"] == "0o600", aws
            assert aws["path"] == str(state_dir / "secrets" / ".aws" / "credentials")
            assert r["files"]["KUBECONFIG"]["path"] == str(
                state_dir / "secrets" / ".kube" / "config"
            )
        assert stat.S_IMODE((state_dir / "secrets").stat().st_mode) == 0o700
        assert stat.S_IMODE((state_dir / "secrets" / ".aws").stat().st_mode) == 0o700
        # the user's own files are read, never written
        assert sorted(p.name for p in (home / ".aws").iterdir()) == ["credentials"]
    finally:
        remote.teardown()
    assert not (Path(os.environ["KTLITE_HOME"]) / "local" / name).exists(), (
        "teardown removes the files"
    )


def test_a_changed_value_restarts_the_local_pods(home: Path) -> None:
    name = unique("secrets-change")

    def deploy(value: str) -> object:
        compute = kt.Compute(
            secrets=[kt.secret(name="db", env_vars={"DB_PASSWORD": value})], launch_timeout=120
        )
        return kt.fn(read_on_rank).to(compute, name=name)

    remote = deploy("first")
    try:
        assert remote(["DB_PASSWORD"], [])["env"] == {"DB_PASSWORD": digest("first")}
        pids = [p["pid"] for p in LocalBackend.shared()._read(name)["pods"]]
        remote = deploy("first")  # unchanged: the same pod
        assert [p["pid"] for p in LocalBackend.shared()._read(name)["pods"]] == pids
        remote = deploy("second")
        assert remote(["DB_PASSWORD"], [])["env"] == {"DB_PASSWORD": digest("second")}
        assert [p["pid"] for p in LocalBackend.shared()._read(name)["pods"]] != pids
    finally:
        remote.teardown()


@pytest.mark.parametrize("secret", ["my-k8s-secret", "aws"])
def test_local_refuses_before_anything_starts(home: Path, secret: str) -> None:
    # a bare name is a Kubernetes Secret, which the local backend has none of; a preset that
    # finds nothing fails too: neither leaves a pod or a state dir behind
    name = unique("secrets-refused")
    with pytest.raises(kt.ConfigError, match=repr(secret)):
        kt.fn(read_on_rank).to(kt.Compute(secrets=[secret]), name=name)
    assert not (Path(os.environ["KTLITE_HOME"]) / "local" / name).exists()


def test_ssh_plan_names_keys_and_files_never_values(home: Path) -> None:
    pytest.importorskip("asyncssh")
    from ktlite.backends.ssh import SshBackend

    put(home, ".aws/credentials", f"[default]\nkey = {VALUE}\n")
    compute = kt.Compute(
        hosts=["gpu1"], secrets=["aws", kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})]
    )
    text = str(SshBackend().plan(DeploymentSpec("ssh-secrets", compute.pod_spec())))
    assert "DB_PASSWORD=..." in text and VALUE not in text
    assert "bytes from ~/.aws/credentials> goes to <run dir>/secrets/.aws/credentials" in text
    with pytest.raises(kt.ConfigError, match="no meaning on backend 'ssh'"):
        SshBackend().plan(
            DeploymentSpec(
                "ssh-secrets", kt.Compute(hosts=["gpu1"], secrets=["team-secret"]).pod_spec()
            )
        )


@pytest.mark.ssh
@pytest.mark.timeout(180)
def test_kubetorch_form_ssh_ranks_get_env_and_file_secrets(home: Path, tmp_path: Path) -> None:
    import sys

    from ssh_hosts import SshHosts, sshd_available

    if not sshd_available():
        pytest.skip("needs /usr/sbin/sshd")
    credentials = put(home, ".aws/credentials", f"[default]\nkey = {VALUE}\n").read_bytes()
    with SshHosts(tmp_path / "ssh", count=1) as hosts:
        options = kt.Hosts(
            [h.name for h in hosts.hosts],
            ssh_config=str(hosts.ssh_config),
            known_hosts=str(hosts.known_hosts),
            python=sys.executable,
        )
        compute = kt.Compute(
            hosts=options, secrets=["aws", kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})]
        )
        remote = kt.fn(read_on_rank).to(compute, name=unique("secrets-ssh"))
        try:
            (r,) = remote(["DB_PASSWORD"], ["AWS_SHARED_CREDENTIALS_FILE"])
            assert r["env"] == {"DB_PASSWORD": digest(VALUE)}
            aws = r["files"]["AWS_SHARED_CREDENTIALS_FILE"]
            assert aws["digest"] == digest(credentials) and aws["mode"] == "0o600", aws
            assert aws["path"].endswith("/secrets/.aws/credentials")
            secret_dir = Path(aws["path"]).parent.parent  # the host is this machine
            assert stat.S_IMODE(secret_dir.stat().st_mode) == 0o700
        finally:
            remote.teardown()
        assert not secret_dir.exists(), "teardown removes the run dir and its secrets"


# ---- a known value, searched for everywhere ktlite writes --------------------------------------


def test_a_secret_value_appears_in_no_repr_plan_error_state_or_log(
    home: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    put(home, ".aws/credentials", f"[default]\naws_secret_access_key = {VALUE}\n")
    monkeypatch.setenv("OPENAI_API_KEY", VALUE)
    secrets = ["aws", "openai", kt.secret(name="db", env_vars={"DB_PASSWORD": VALUE})]
    seen: list[str] = []

    compute = kt.Compute(secrets=secrets, launch_timeout=120)
    seen += [repr(s) for s in compute.secrets] + [repr(compute), repr(resolve(compute.secrets))]
    seen.append(str(kt.fn(read_on_rank).to(compute, name="plan-local", dryrun=True)))
    assert (
        "<redacted: " in seen[-1]
        and "DB_PASSWORD=..." in seen[-1]
        and "OPENAI_API_KEY=..." in seen[-1]
    )
    kube = kt.Compute(backend="kubernetes", secrets=secrets)
    kube_plan = kt.fn(read_on_rank).to(kube, name="plan-kube", dryrun=True)
    seen.append(str(kube_plan))
    assert "<redacted:" in seen[-1] and "from $OPENAI_API_KEY" in seen[-1]
    for bad in (
        [*secrets, kt.secret(name="x", env_vars={"OPENAI_API_KEY": VALUE})],  # a clash
        [kt.secret(name="x", env_vars={"A": VALUE}), "not-here"],
    ):  # no such local secret
        with pytest.raises(kt.ConfigError) as info:
            kt.fn(read_on_rank).to(kt.Compute(secrets=bad), name=unique("bad"))
        seen.append(str(info.value))

    name = unique("secrets-grep")
    remote = kt.fn(read_on_rank).to(compute, name=name)
    try:
        print(remote(["DB_PASSWORD"], ["AWS_SHARED_CREDENTIALS_FILE"]))
        print(remote, remote.deployment, remote.deployment.applied)
        state_dir = Path(os.environ["KTLITE_HOME"]) / "local" / name
        for path in state_dir.rglob("*"):
            if path.is_file() and "secrets" not in path.relative_to(state_dir).parts:
                seen.append(f"{path}: " + path.read_bytes().decode(errors="replace"))
            elif path.is_file():  # the secret files themselves: this user's only
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert any("state.json" in s for s in seen) and any("pod-0.log" in s for s in seen)
        seen.append(remote.logs())
    finally:
        remote.teardown()
    out, err = capfd.readouterr()
    seen += [out, err]
    leaks = [s[:200] for s in seen if VALUE in s]
    assert not leaks, leaks
