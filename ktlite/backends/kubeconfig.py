"""Where the cluster is and how to prove who we are: a kubeconfig, or a pod's service account.

ktlite reads them itself, as kubectl does, so that a process pays no ``import kubernetes``
(0.2-1.6 s: its configuration loaders pull in google-auth, oauthlib, requests and the dynamic
client) before its first request. Read here: ``KUBECONFIG`` (several files, the first to set
a value wins) or ``~/.kube/config``, the current or a named context and its namespace; a
cluster's ``server``, ``certificate-authority(-data)``, ``insecure-skip-tls-verify`` and
``proxy-url``; a user's ``token``, ``tokenFile``, ``client-certificate(-data)`` /
``client-key(-data)``, ``username``/``password`` and ``exec`` credential plugins (re-run when
their credential expires). A user with an ``auth-provider`` (gcp, azure, oidc: kubectl's
deprecated form) is loaded by the official ``kubernetes`` client's loader, imported then.
Paths in a file are relative to that file. Secret values stay out of reprs and errors.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ktlite.errors import KubernetesCredentialsError

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_REREAD_S = 60.0  # a projected service-account token rotates; kubelet rewrites the file


@dataclass(frozen=True)
class Credentials:
    """What an HTTP client needs for one cluster (PEM bytes or file paths; no secret in repr)."""

    host: str
    context: str
    namespace: str
    in_cluster: bool
    verify: bool = True
    ca_file: str | None = None
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_file: str | None = None
    key_file: str | None = None
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    proxy: str | None = None
    # the Authorization header's value for the next request (tokens rotate), or None
    authorization: Callable[[], str | None] = field(default=lambda: None, repr=False)


class CredentialsError(Exception):
    """A kubeconfig that cannot be used; its message names no secret."""


def load(
    kubeconfig: str | None, context: str | None, *, environ: Mapping[str, str] = os.environ
) -> Credentials:
    """The cluster of ``kubeconfig`` (else ``KUBECONFIG``, else ~/.kube/config) and
    ``context`` (else its current context); in a pod with a service account and no
    kubeconfig named anywhere, the pod's own."""
    in_cluster = (
        kubeconfig is None
        and context is None
        and not environ.get("KUBECONFIG")
        and "KUBERNETES_SERVICE_HOST" in environ
        and os.path.exists(f"{SERVICE_ACCOUNT}/token")
    )
    where = kubeconfig or environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        if in_cluster:
            return _in_cluster(environ)
        return _from_files(where, context)
    except (CredentialsError, OSError, ValueError, TypeError, KeyError) as e:
        raise KubernetesCredentialsError(
            f"could not load a Kubernetes configuration from {where}"
            f"{f' (context {context!r})' if context else ''}: {e}; point KUBECONFIG at your "
            "cluster's kubeconfig, or check `kubectl config get-contexts`"
        ) from e


def _in_cluster(environ: Mapping[str, str]) -> Credentials:
    host, port = (
        environ.get("KUBERNETES_SERVICE_HOST", ""),
        environ.get("KUBERNETES_SERVICE_PORT", ""),
    )
    if not host or not port:
        raise CredentialsError("KUBERNETES_SERVICE_HOST/PORT are not set")
    token = _TokenFile(f"{SERVICE_ACCOUNT}/token")
    token()  # an empty or unreadable token fails here
    try:
        with open(f"{SERVICE_ACCOUNT}/namespace") as f:
            namespace = f.read().strip() or "default"
    except OSError:
        namespace = "default"
    return Credentials(
        host=f"https://{f'[{host}]' if ':' in host else host}:{port}",
        context="in-cluster",
        namespace=namespace,
        in_cluster=True,
        ca_file=f"{SERVICE_ACCOUNT}/ca.crt",
        authorization=lambda: f"Bearer {token()}",
    )


def _read_files(paths: str) -> dict[str, Any]:
    """The merged kubeconfig of ``paths`` (os.pathsep-separated; missing files skipped) as
    kubectl merges them: the first file to set the current context or to name a cluster, user
    or context wins. Each entry keeps the directory of its file (``_dir``) for relative paths."""
    try:
        import yaml  # the kubernetes extra's (only a kubeconfig needs it)
    except ImportError as e:
        raise CredentialsError(
            "reading a kubeconfig needs PyYAML: pip install 'ktlite[kubernetes]'"
        ) from e

    merged: dict[str, Any] = {"current-context": None, "clusters": {}, "users": {}, "contexts": {}}
    found = False
    for raw in paths.split(os.pathsep):
        path = os.path.expanduser(raw) if raw else ""
        if not path or not os.path.exists(path):
            continue
        with open(path) as f:
            try:
                doc = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise CredentialsError(f"{path} is not valid YAML: {e}") from e
        if not isinstance(doc, dict):
            raise CredentialsError(f"{path} is not a kubeconfig (a YAML mapping)")
        found = True
        base = os.path.dirname(os.path.abspath(path))
        merged["current-context"] = merged["current-context"] or doc.get("current-context") or None
        for section in ("clusters", "users", "contexts"):
            for entry in doc.get(section) or []:
                body = entry.get(section[:-1]) if isinstance(entry, dict) else None
                if not isinstance(body or {}, dict):
                    raise CredentialsError(f"{path}: an entry of {section} is not a mapping")
                name = entry.get("name") if isinstance(entry, dict) else None
                if name is not None and name not in merged[section]:
                    merged[section][name] = {**(body or {}), "_dir": base}
    if not found:
        raise CredentialsError(f"no kubeconfig file found at {paths}")
    return merged


def _from_files(paths: str, context: str | None) -> Credentials:
    config = _read_files(paths)
    name = context or config.get("current-context")
    if not name:
        raise CredentialsError("no context named and the kubeconfig has no current-context")
    if name not in config["contexts"]:
        raise CredentialsError(
            f"context {name!r} is not in the kubeconfig; it has: "
            f"{', '.join(sorted(config['contexts'])) or 'none'}"
        )
    ctx = config["contexts"][name]
    cluster = config["clusters"].get(ctx.get("cluster"))
    if cluster is None or not cluster.get("server"):
        raise CredentialsError(
            f"context {name!r} names cluster {ctx.get('cluster')!r}, which the "
            "kubeconfig does not define (with a server)"
        )
    user = config["users"].get(ctx.get("user")) or {}
    namespace = ctx.get("namespace") or "default"
    if user.get("auth-provider"):
        return _official(paths, name, namespace)
    host = str(cluster["server"]).rstrip("/")
    creds: dict[str, Any] = {
        "host": host,
        "context": name,
        "namespace": namespace,
        "in_cluster": False,
        "verify": not cluster.get("insecure-skip-tls-verify", False),
        "proxy": cluster.get("proxy-url") or None,
    }
    if host.startswith("https"):
        creds["ca_file"], creds["ca_pem"] = _file_or_data(cluster, "certificate-authority")
        creds["cert_file"], creds["cert_pem"] = _file_or_data(user, "client-certificate")
        creds["key_file"], creds["key_pem"] = _file_or_data(user, "client-key")
    if user.get("token") or user.get("tokenFile"):
        token = user.get("token") or _TokenFile(_path(user, user["tokenFile"]))
        creds["authorization"] = (
            (lambda: f"Bearer {token}") if isinstance(token, str) else (lambda: f"Bearer {token()}")
        )
    elif user.get("exec"):
        plugin = ExecPlugin(user["exec"], cluster)
        creds["authorization"] = plugin.authorization
        cert, key = plugin.certificate()
        if cert is not None:  # the plugin gave a client certificate instead of a token
            creds.update(cert_file=None, key_file=None, cert_pem=cert, key_pem=key)
    elif user.get("username") and user.get("password"):
        basic = base64.b64encode(f"{user['username']}:{user['password']}".encode()).decode()
        creds["authorization"] = lambda: f"Basic {basic}"
    return Credentials(**creds)


def _path(entry: dict[str, Any], value: str) -> str:
    return os.path.normpath(os.path.join(entry["_dir"], os.path.expanduser(value)))


def _file_or_data(entry: dict[str, Any], key: str) -> tuple[str | None, bytes | None]:
    """``key-data`` (base64, preferred) as PEM bytes, else ``key`` as a path (relative to
    the entry's file)."""
    if entry.get(f"{key}-data"):
        try:
            return None, base64.b64decode(entry[f"{key}-data"], validate=True)
        except ValueError as e:
            raise CredentialsError(f"{key}-data is not valid base64") from e
    if entry.get(key):
        path = _path(entry, entry[key])
        if not os.path.isfile(path):
            raise CredentialsError(f"{key} {path} does not exist")
        return path, None
    return None, None


class _TokenFile:
    """A token kept in a file (a ``tokenFile``, a pod's service-account token), read again
    every minute: the kubelet rotates projected tokens."""

    def __init__(self, path: str) -> None:
        self.path, self._token, self._read_at = path, "", -TOKEN_REREAD_S
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            if time.monotonic() - self._read_at >= TOKEN_REREAD_S:
                with open(self.path) as f:
                    token = f.read().strip()
                if not token:
                    raise CredentialsError(f"the token file {self.path} is empty")
                self._token, self._read_at = token, time.monotonic()
            return self._token

    def __repr__(self) -> str:
        return f"_TokenFile({self.path!r})"


class ExecPlugin:
    """A client-go credential plugin (``users[].user.exec``: aws eks get-token,
    gke-gcloud-auth-plugin, kubelogin...): run once, then again when the credential it gave
    expires (``expirationTimestamp``)."""

    def __init__(self, spec: dict[str, Any], cluster: dict[str, Any]) -> None:
        if not spec.get("command") or not spec.get("apiVersion"):
            raise CredentialsError("exec: the plugin entry needs command and apiVersion")
        self.spec, self.cluster = spec, cluster
        self._status: dict[str, Any] | None = None
        self._expires: float | None = None  # epoch seconds
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ExecPlugin({self.spec['command']!r})"

    def _credential(self) -> dict[str, Any]:
        with self._lock:
            if self._status is None or (self._expires is not None and time.time() >= self._expires):
                self._status = self._run()
                stamp = self._status.get("expirationTimestamp")
                self._expires = _epoch(stamp) if stamp else None
            return self._status

    def authorization(self) -> str | None:
        token = self._credential().get("token")
        return f"Bearer {token}" if token else None

    def certificate(self) -> tuple[bytes | None, bytes | None]:
        status = self._credential()
        if status.get("token") or not status.get("clientCertificateData"):
            return None, None
        if not status.get("clientKeyData"):
            raise CredentialsError(
                "exec: the plugin gave clientCertificateData without clientKeyData"
            )
        return status["clientCertificateData"].encode(), status["clientKeyData"].encode()

    def _run(self) -> dict[str, Any]:
        interactive = sys.stdout.isatty() and self.spec.get("interactiveMode") != "Never"
        info: dict[str, Any] = {
            "apiVersion": self.spec["apiVersion"],
            "kind": "ExecCredential",
            "spec": {"interactive": interactive},
        }
        if self.spec.get("provideClusterInfo"):
            info["spec"]["cluster"] = {k: v for k, v in self.cluster.items() if k != "_dir"}
        env = {
            **os.environ,
            **{e["name"]: e["value"] for e in self.spec.get("env") or []},
            "KUBERNETES_EXEC_INFO": json.dumps(info),
        }
        command = [self.spec["command"], *(self.spec.get("args") or [])]
        try:
            proc = subprocess.run(
                command,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=self.cluster["_dir"],
                timeout=120,
                stdin=None if interactive else subprocess.DEVNULL,
                stderr=None if interactive else subprocess.PIPE,
            )
        except FileNotFoundError as e:
            hint = self.spec.get("installHint") or ""
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} not found"
                + (f"; {hint.strip()}" if hint else "")
            ) from e
        except subprocess.TimeoutExpired as e:
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} did not answer within 120 s"
            ) from e
        if proc.returncode != 0:
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} exited {proc.returncode}"
                + (f": {proc.stderr.strip()[-500:]}" if proc.stderr and proc.stderr.strip() else "")
            )
        try:
            data = json.loads(proc.stdout)
        except ValueError as e:
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} printed no ExecCredential JSON"
            ) from e
        if not isinstance(data, dict) or not isinstance(data.get("status"), dict):
            raise CredentialsError(f"exec: credential plugin {command[0]!r} printed no status")
        if data.get("apiVersion") != self.spec["apiVersion"]:
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} answered apiVersion "
                f"{data.get('apiVersion')!r}, not {self.spec['apiVersion']!r}"
            )
        status: dict[str, Any] = data["status"]
        if not status.get("token") and not status.get("clientCertificateData"):
            raise CredentialsError(
                f"exec: credential plugin {command[0]!r} gave neither a token nor a "
                "client certificate"
            )
        return status


def _epoch(stamp: str) -> float:
    """RFC 3339 (``2026-01-02T03:04:05Z``, fractions and offsets too) as epoch seconds."""
    text = stamp.strip().replace("Z", "+00:00").replace("z", "+00:00")
    if "." in text:  # Python 3.10's fromisoformat takes 3 or 6 fraction digits only
        head, tail = text.split(".", 1)
        digits = len(tail) - len(tail.lstrip("0123456789"))
        text = head + tail[digits:]
    return datetime.datetime.fromisoformat(text).timestamp()


def _official(paths: str, context: str, namespace: str) -> Credentials:
    """A user with an ``auth-provider``: the official client's loader (imported now)."""
    try:
        from kubernetes import client as kclient
        from kubernetes import config as kconfig
    except ImportError as e:
        raise CredentialsError(
            "its user has an auth-provider, which needs the kubernetes client: "
            "pip install 'ktlite[kubernetes]'"
        ) from e
    configuration = kclient.Configuration()
    try:
        kconfig.load_kube_config(  # type: ignore[no-untyped-call]  # the kubernetes client has no types
            config_file=paths,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except kconfig.ConfigException as e:
        raise CredentialsError(str(e)) from e

    def authorization() -> str | None:
        # auth_settings() runs the loader's refresh hook, and names the header whatever key this
        # client release keeps the token under
        settings: dict[str, Any] = dict(configuration.auth_settings())
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                return str(setting["value"])
        return None

    return Credentials(
        host=configuration.host,
        context=context,
        namespace=namespace,
        in_cluster=False,
        verify=bool(configuration.verify_ssl),
        ca_file=configuration.ssl_ca_cert or None,
        cert_file=configuration.cert_file or None,
        key_file=configuration.key_file or None,
        proxy=configuration.proxy or None,
        authorization=authorization,
    )
