"""Reading kubeconfigs without the ``kubernetes`` package (``ktlite.backends.kubeconfig``).

A CLI command against a cluster imports no ``kubernetes`` module (a fresh process, as a user
runs it). The kubeconfigs users have are read as the official client reads them (it is the
oracle here: same host, TLS material, proxy and Authorization header), and a real exec
credential plugin, a plugin's client certificate over real TLS and a pod's rotating
service-account token are used against a real HTTP(S) server.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_kube_backend import _ApiServer, _server_tls, no_proxy, pki, write_kubeconfig

from ktlite.backends import kubeconfig
from ktlite.backends.kube_api import ClusterInfo, KubeApi, load
from ktlite.errors import KubernetesCredentialsError

__all__ = ["no_proxy", "pki"]  # fixtures used here
HEAVY = ("kubernetes", "google", "oauthlib", "requests_oauthlib")


def _heavy_after(args: list[str], env: dict[str, str]) -> tuple[int, list[str], str]:
    """Run ``ktlite ARGS`` in a fresh process; its exit code, the heavy modules it had
    imported by the end, and its stderr."""
    code = textwrap.dedent(f"""
        import sys
        from ktlite.commands.cli import main
        rc = main({args!r})
        print("HEAVY", ",".join(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})))
        sys.exit(rc)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HEAVY")), "HEAVY ")
    return proc.returncode, [m for m in line[6:].split(",") if m], proc.stderr


def test_a_cli_command_against_a_cluster_and_a_plan_import_no_kubernetes_module(
    tmp_path: Path, no_proxy: None
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env.update(KTLITE_HOME=str(tmp_path / "home"))
    with _ApiServer() as server:
        env["KUBECONFIG"] = write_kubeconfig(
            tmp_path / "config",
            clusters={"c": {"server": server.url}},
            users={"u": {"token": "t"}},
            contexts={"a": {"cluster": "c", "user": "u", "namespace": "ns-a"}},
            current="a",
        )
        rc, heavy, err = _heavy_after(["list", "--backend", "kubernetes"], env)
        assert rc == 0, err
        assert any(
            "/namespaces/ns-a/statefulsets" in path for path, _ in server.seen
        )  # it asked the cluster
    assert heavy == []
    script = tmp_path / "svc.py"
    script.write_text(
        "import ktlite as kt\n\n@kt.compute(cpus=1, backend='kubernetes')\n"
        "@kt.distribute('pytorch', workers=2)\ndef step(x):\n    return x\n"
    )
    rc, heavy, err = _heavy_after(["deploy", f"{script}:step", "--dry-run"], env)
    assert rc == 0, err
    assert heavy == []


# ---- the official client as the oracle ----------------------------------------------------------


def _official(path: str, context: str | None) -> dict[str, Any]:
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    cfg = kclient.Configuration()
    kconfig.load_kube_config(
        config_file=path, context=context, client_configuration=cfg, persist_config=False
    )
    header = next(
        (s["value"] for s in cfg.auth_settings().values() if s.get("in") == "header"), None
    )
    if header is None and cfg.username and cfg.password:
        header = cfg.get_basic_auth_token()

    def read(name: str | None) -> bytes | None:
        return Path(name).read_bytes() if name else None

    return {
        "host": cfg.host,
        "verify": bool(cfg.verify_ssl),
        "ca": read(cfg.ssl_ca_cert),
        "cert": read(cfg.cert_file),
        "key": read(cfg.key_file),
        "proxy": cfg.proxy or None,
        "authorization": header,
    }


def _ours(path: str, context: str | None) -> dict[str, Any]:
    c = kubeconfig.load(path, context)

    def pem(file: str | None, data: bytes | None) -> bytes | None:
        return data if data is not None else (Path(file).read_bytes() if file else None)

    return {
        "host": c.host,
        "verify": c.verify,
        "ca": pem(c.ca_file, c.ca_pem),
        "cert": pem(c.cert_file, c.cert_pem),
        "key": pem(c.key_file, c.key_pem),
        "proxy": c.proxy,
        "authorization": c.authorization(),
    }


def _plugin(
    tmp_path: Path,
    status: dict[str, Any],
    name: str = "plugin.py",
    api: str = "client.authentication.k8s.io/v1",
    stderr: str = "",
    exit_code: int = 0,
    numbered: bool = True,
) -> Path:
    """A real credential plugin: prints an ExecCredential with ``status`` (its token ending in
    ``-run<N>`` if ``numbered``), counts its runs in ``<name>.runs`` and keeps the
    KUBERNETES_EXEC_INFO, env and directory it got in ``<name>.seen``."""
    plugin = tmp_path / name
    plugin.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        here = Path(__file__)
        runs = here.with_suffix(".runs")
        n = int(runs.read_text()) + 1 if runs.exists() else 1
        runs.write_text(str(n))
        here.with_suffix(".seen").write_text(json.dumps({{
            "info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]), "region": os.environ.get("REGION"),
            "cwd": os.getcwd()}}))
        status = json.loads({json.dumps(status)!r})
        if "token" in status and {numbered!r}:
            status["token"] += f"-run{{n}}"
        sys.stderr.write({stderr!r})
        print(json.dumps({{"apiVersion": {api!r}, "kind": "ExecCredential", "status": status}}))
        sys.exit({exit_code})
    """)
    )
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    return plugin


def _cases(tmp_path: Path, pki: Path) -> dict[str, tuple[str, str | None]]:
    certs = tmp_path / "certs"
    certs.mkdir()
    for name in ("ca.crt", "client.crt", "client.key"):
        (certs / name).write_bytes((pki / name).read_bytes())
    (tmp_path / "token-file").write_text(
        "from-a-file"
    )  # the official client keeps a newline; kubectl trims it
    b64 = {
        n: base64.b64encode((pki / n).read_bytes()).decode()
        for n in ("ca.crt", "client.crt", "client.key")
    }
    plugin = _plugin(
        tmp_path,
        {"token": "exec-token", "expirationTimestamp": "2999-01-01T00:00:00Z"},
        numbered=False,
    )
    users = {
        "token": {"token": "tok-123"},
        "token-file": {"tokenFile": "token-file"},  # relative to the kubeconfig's directory
        "cert-files": {"client-certificate": "certs/client.crt", "client-key": "certs/client.key"},
        "cert-data": {
            "client-certificate-data": b64["client.crt"],
            "client-key-data": b64["client.key"],
        },
        "basic": {"username": "ann", "password": "s3cret"},
        "exec": {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": str(plugin),
                "env": [{"name": "REGION", "value": "eu-1"}],
                "interactiveMode": "Never",
            }
        },
    }
    clusters = {
        "ca-file": {"server": "https://10.1.0.1:6443/", "certificate-authority": "certs/ca.crt"},
        "ca-data": {
            "server": "https://10.1.0.2:6443",
            "certificate-authority-data": b64["ca.crt"],
            "proxy-url": "http://proxy.example:3128",
        },
        "insecure": {"server": "https://10.1.0.3:6443", "insecure-skip-tls-verify": True},
        "plain": {"server": "http://127.0.0.1:8080"},
    }
    contexts = {f"{u}@{c}": {"cluster": c, "user": u} for u in users for c in clusters}
    one = write_kubeconfig(
        tmp_path / "config",
        clusters=clusters,
        users=users,
        contexts=contexts,
        current="token@ca-file",
    )
    # two files, as KUBECONFIG lists them: the first to name an entry wins
    (tmp_path / "second").mkdir()
    second = write_kubeconfig(
        tmp_path / "second" / "config",
        clusters={"ca-file": {"server": "https://wrong:1"}, "extra": clusters["ca-data"]},
        users={"token": {"token": "wrong"}, "extra": {"token": "extra-tok"}},
        contexts={"extra": {"cluster": "extra", "user": "extra", "namespace": "x"}},
        current="extra",
    )
    both = os.pathsep.join([one, str(tmp_path / "missing"), second])
    cases: dict[str, tuple[str, str | None]] = {name: (one, name) for name in contexts}
    cases["current"] = (one, None)
    cases["merged-first-wins"] = (both, "token@ca-file")
    cases["merged-from-second"] = (both, "extra")
    return cases


def test_kubeconfigs_are_read_as_the_official_client_reads_them(tmp_path: Path, pki: Path) -> None:
    cases = _cases(tmp_path, pki)
    assert len(cases) == 27
    for name, (path, context) in cases.items():
        ours, official = _ours(path, context), _official(path, context)
        assert ours == official, f"{name}: {ours} != {official}"
    said = json.loads((tmp_path / "plugin.seen").read_text())
    assert said["info"] == {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "spec": {"interactive": False},
    }
    assert said["region"] == "eu-1" and said["cwd"] == str(tmp_path)


def test_the_first_file_sets_the_current_context_as_kubectl_has_it(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    a = write_kubeconfig(
        tmp_path / "a",
        clusters={"c": {"server": "http://a:1"}},
        users={"u": {"token": "a"}},
        contexts={"in-a": {"cluster": "c", "user": "u", "namespace": "from-a"}},
        current="in-a",
    )
    b = write_kubeconfig(
        tmp_path / "b" / "b",
        clusters={"d": {"server": "http://b:1"}},
        users={"v": {}},
        contexts={"in-b": {"cluster": "d", "user": "v"}},
        current="in-b",
    )
    creds = kubeconfig.load(os.pathsep.join([a, b]), None)
    assert (creds.context, creds.host, creds.namespace) == ("in-a", "http://a:1", "from-a")
    assert kubeconfig.load(os.pathsep.join([a, b]), "in-b").authorization() is None


# ---- exec plugins, service accounts --------------------------------------------------------------


def _exec_kubeconfig(tmp_path: Path, server: str, plugin: Path, **extra: Any) -> str:
    return write_kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": server}},
        users={
            "u": {
                "exec": {
                    "apiVersion": "client.authentication.k8s.io/v1",
                    "command": str(plugin),
                    **extra,
                }
            }
        },
        contexts={"a": {"cluster": "c", "user": "u"}},
        current="a",
    )


def test_an_exec_plugin_runs_again_only_once_its_credential_expired(
    tmp_path: Path, no_proxy: None
) -> None:
    with _ApiServer() as server:
        lasting = _plugin(
            tmp_path,
            {"token": "t", "expirationTimestamp": "2999-01-01T00:00:00.123456789Z"},
            "lasting.py",
        )
        client, info = load(_exec_kubeconfig(tmp_path, server.url, lasting))
        with client:
            api = KubeApi(client, info.namespace)
            api.list("Pod")
            api.list("Pod")
        assert [a for _, a in server.seen] == ["Bearer t-run1", "Bearer t-run1"]
        assert (tmp_path / "lasting.runs").read_text() == "1"
        expired = _plugin(
            tmp_path,
            {"token": "t", "expirationTimestamp": "2001-01-01T00:00:00+00:00"},
            "expired.py",
        )
        client, info = load(_exec_kubeconfig(tmp_path, server.url, expired))
        with client:
            api = KubeApi(client, info.namespace)
            api.list("Pod")
            api.list("Pod")
        assert [a for _, a in server.seen[2:]] == ["Bearer t-run2", "Bearer t-run3"]  # run1 at load
        assert "t-run" not in repr(client.auth)


def test_an_exec_plugin_that_fails_or_is_missing_says_so(tmp_path: Path, no_proxy: None) -> None:
    failing = _plugin(
        tmp_path,
        {},
        "failing.py",
        stderr="error: no SSO session, run `aws sso login`\n",
        exit_code=1,
    )
    with pytest.raises(
        KubernetesCredentialsError,
        match=r"credential plugin .*failing\.py' exited 1: "
        r"error: no SSO session, run `aws sso login`.*KUBECONFIG",
    ):
        load(_exec_kubeconfig(tmp_path, "https://10.0.0.1:6443", failing))
    with pytest.raises(
        KubernetesCredentialsError,
        match="credential plugin 'no-such-plugin' not found; "
        "install it with brew install no-such-plugin",
    ):
        load(
            _exec_kubeconfig(
                tmp_path,
                "https://10.0.0.1:6443",
                Path("no-such-plugin"),
                installHint="install it with brew install no-such-plugin\n",
            )
        )
    wrong = _plugin(
        tmp_path, {"token": "t"}, "wrong.py", api="client.authentication.k8s.io/v1beta1"
    )
    with pytest.raises(
        KubernetesCredentialsError,
        match="answered apiVersion 'client.authentication.k8s.io/"
        "v1beta1', not 'client.authentication.k8s.io/v1'",
    ):
        load(_exec_kubeconfig(tmp_path, "https://10.0.0.1:6443", wrong))


@pytest.mark.timeout(60)
def test_an_exec_plugins_client_certificate_over_real_tls(
    pki: Path, tmp_path: Path, no_proxy: None
) -> None:
    plugin = _plugin(
        tmp_path,
        {
            "clientCertificateData": (pki / "client.crt").read_text(),
            "clientKeyData": (pki / "client.key").read_text(),
        },
    )
    with _ApiServer(_server_tls(pki, require_client_cert=True)) as server:
        path = write_kubeconfig(
            tmp_path / "config",
            clusters={"c": {"server": server.url, "certificate-authority": str(pki / "ca.crt")}},
            users={
                "u": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": str(plugin),
                    }
                }
            },
            contexts={"a": {"cluster": "c", "user": "u"}},
            current="a",
        )
        client, info = load(path)
        with client:
            assert KubeApi(client, info.namespace).list("Pod") == []
        assert (
            server.seen == [("/api/v1/namespaces/default/pods?limit=500", None)]
            and server.handshake_errors == []
        )
    assert not list(
        Path(os.environ.get("TMPDIR", "/tmp")).glob("ktlite-cert-*")
    )  # no key left on disk


@pytest.mark.timeout(60)
def test_in_a_pod_the_service_account_is_used_and_its_token_reread(
    pki: Path, tmp_path: Path, no_proxy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    (account / "token").write_text("sa-token-1")
    (account / "namespace").write_text("team-pods\n")
    monkeypatch.setattr(kubeconfig, "SERVICE_ACCOUNT", str(account))
    monkeypatch.setattr(kubeconfig, "TOKEN_REREAD_S", 0.0)  # the kubelet rotated it: read at once
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with _ApiServer(_server_tls(pki, require_client_cert=False)) as server:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
        client, info = load()
        with client:
            assert info == ClusterInfo(server.url, "in-cluster", "team-pods", True)
            api = KubeApi(client, info.namespace)
            api.list("Pod")
            (account / "token").write_text("sa-token-2")
            api.list("Pod")
        assert [a for _, a in server.seen] == ["Bearer sa-token-1", "Bearer sa-token-2"]
