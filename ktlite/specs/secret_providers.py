"""Provider presets of ``kt.secret(provider=...)``: where each reads its values on this machine
and how the pods get them (env vars, or files at the provider's usual path under the home).

Each reader returns a :class:`Found`, or raises :class:`ConfigError` naming the provider,
every place it looked and the fix. Values never enter a message: errors name files and
variables only. Every path honours ``HOME`` and the provider's own variables, so tests (and
users) can point them anywhere.
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ktlite.errors import ConfigError

_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # what a Kubernetes Secret accepts as a data key


@dataclass(frozen=True)
class SecretFile:
    """One file a secret puts on every pod: ``pod_path`` is relative to the pod's home;
    ``pointer`` is the env var tools read its location from (set on the pods too)."""

    key: str
    pod_path: str
    data: bytes = field(repr=False)
    source: str
    pointer: str | None = None
    mode: int = 0o400

    def __post_init__(self) -> None:
        if not _KEY.match(self.key):
            raise ConfigError(
                f"secret file {self.source}: its name {self.key!r} cannot be a Secret key; "
                "rename it to letters, digits, '-', '_' and '.'"
            )


@dataclass(frozen=True)
class Found:
    """What a preset found: env vars (name -> (value, where it came from)) and files."""

    env: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)
    files: tuple[SecretFile, ...] = ()


def shown(path: Path | str) -> str:
    """``path`` with the home written as ``~`` (for messages and placeholders)."""
    text = str(path)
    home = str(Path.home())
    return (
        "~" + text[len(home) :]
        if home != "/" and (text == home or text.startswith(home + "/"))
        else text
    )


def _expand(path: str) -> Path:
    return Path(os.path.expanduser(path))


def read_file(path: Path, provider: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(
            f"secret provider {provider!r}: cannot read {shown(path)}: {e.strerror}; "
            "check the file's permissions"
        ) from None


def missing(provider: str, looked: list[str], fix: str) -> ConfigError:
    return ConfigError(
        f"secret provider {provider!r} found nothing on this machine; looked at: "
        f"{', '.join(looked)}. {fix}"
    )


def _from_env(names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``names`` set (non-empty) here: (value, "$NAME")."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value, f"${name}"
    return None


# ---- token providers: one value, exposed under one or more env names -------------------------

TokenFile = Callable[[Path], str | None]  # reads the token out of a file (None: not in it)


def _plain(path: Path) -> str | None:
    return path.read_text(errors="replace").strip() or None


def _netrc_wandb(path: Path) -> str | None:
    try:
        entry = netrc.netrc(str(path)).authenticators("api.wandb.ai")
    except netrc.NetrcParseError as e:  # its message may quote a line of the file: not shown
        raise ConfigError(
            f"secret provider 'wandb': {shown(path)} is not a valid netrc file (line "
            f"{e.lineno}); fix it or run `wandb login`"
        ) from None
    return entry[2] if entry and entry[2] else None


def _lambda_keys(path: Path) -> str | None:
    for line in path.read_text(errors="replace").splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "api_key" and value.strip():
            return value.strip()
    return None


@dataclass(frozen=True)
class TokenPreset:
    """A provider with one token: read from the first env var of ``env`` that is set, else from
    the first existing file of ``files`` (``path=`` replaces them); the pods get it as every
    name of ``expose``."""

    expose: tuple[str, ...]
    env: tuple[str, ...]
    files: tuple[Callable[[], str | None], ...] = ()  # candidate paths (None: not configured)
    reader: TokenFile = _plain
    fix: str = ""

    def find(self, provider: str, path: str | None) -> Found:
        looked: list[str] = []
        got = None if path else _from_env(self.env)
        looked += [] if path else [f"${n}" for n in self.env]
        if got is None:
            candidates = [path] if path else [c() for c in self.files]
            for candidate in filter(None, candidates):
                file = _expand(candidate)
                looked.append(shown(file))
                if file.is_file():
                    try:
                        token = self.reader(file)
                    except OSError as e:
                        raise ConfigError(
                            f"secret provider {provider!r}: cannot read {shown(file)}: {e.strerror}"
                        ) from None
                    if token:
                        got = (token, shown(file))
                        break
        if got is None:
            raise missing(
                provider,
                looked,
                self.fix
                or f"export {self.env[0]}=..., or pass "
                f"kt.secret(provider={provider!r}, env_vars={{'{self.expose[0]}': ...}})",
            )
        return Found(env={name: got for name in self.expose})


def _env_path(var: str, suffix: str = "") -> Callable[[], str | None]:
    return lambda: (os.environ[var] + suffix) if os.environ.get(var) else None


def _fixed(path: str) -> Callable[[], str | None]:
    return lambda: path


TOKENS: dict[str, TokenPreset] = {
    "huggingface": TokenPreset(
        ("HF_TOKEN",),
        ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"),
        (
            _env_path("HF_TOKEN_PATH"),
            _env_path("HF_HOME", "/token"),
            _fixed("~/.cache/huggingface/token"),
        ),
        fix="run `huggingface-cli login`, or export HF_TOKEN=...",
    ),
    "wandb": TokenPreset(
        ("WANDB_API_KEY",),
        ("WANDB_API_KEY",),
        (_env_path("NETRC"), _fixed("~/.netrc")),
        reader=_netrc_wandb,
        fix="run `wandb login`, or export WANDB_API_KEY=...",
    ),
    "openai": TokenPreset(("OPENAI_API_KEY",), ("OPENAI_API_KEY",)),
    "anthropic": TokenPreset(("ANTHROPIC_API_KEY",), ("ANTHROPIC_API_KEY",)),
    "cohere": TokenPreset(("COHERE_API_KEY", "CO_API_KEY"), ("COHERE_API_KEY", "CO_API_KEY")),
    "github": TokenPreset(
        ("GITHUB_TOKEN", "GH_TOKEN"),
        ("GITHUB_TOKEN", "GH_TOKEN"),
        fix="export GITHUB_TOKEN=... (or GH_TOKEN; `gh auth token` prints one)",
    ),
    "lambda": TokenPreset(
        ("LAMBDA_API_KEY",),
        ("LAMBDA_API_KEY",),
        (_fixed("~/.lambda_cloud/lambda_keys"),),
        reader=_lambda_keys,
    ),
    "langchain": TokenPreset(
        ("LANGCHAIN_API_KEY", "LANGSMITH_API_KEY"), ("LANGCHAIN_API_KEY", "LANGSMITH_API_KEY")
    ),
    "pinecone": TokenPreset(("PINECONE_API_KEY",), ("PINECONE_API_KEY",)),
}


# ---- providers with several values or files ----------------------------------------------------


def _aws(path: str | None) -> Found:
    if path:
        base = _expand(path)
        creds, config = (
            (base / "credentials", base / "config")
            if base.is_dir()
            else (base, base.parent / "config")
        )
    else:
        creds = _expand(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials")
        config = _expand(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    if creds.is_file():
        files = [
            SecretFile(
                "credentials",
                ".aws/credentials",
                read_file(creds, "aws"),
                shown(creds),
                "AWS_SHARED_CREDENTIALS_FILE",
            )
        ]
        if config.is_file():
            files.append(
                SecretFile(
                    "config",
                    ".aws/config",
                    read_file(config, "aws"),
                    shown(config),
                    "AWS_CONFIG_FILE",
                )
            )
        return Found(files=tuple(files))
    looked = [shown(creds)]
    if not path:
        key, secret = _from_env(("AWS_ACCESS_KEY_ID",)), _from_env(("AWS_SECRET_ACCESS_KEY",))
        looked.append("$AWS_ACCESS_KEY_ID + $AWS_SECRET_ACCESS_KEY")
        if key and secret:
            env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
            for name in ("AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION"):
                value = _from_env((name,))
                if value:
                    env[name] = value
            return Found(env=env)
    raise missing(
        "aws",
        looked,
        "run `aws configure`, export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "or pass path= (a credentials file or a directory holding one)",
    )


def _one_file(
    provider: str,
    path: str | None,
    candidates: list[str | None],
    key: str,
    pod_path: str,
    pointer: str | None,
    fix: str,
) -> Found:
    looked = []
    for candidate in [path] if path else candidates:
        if not candidate:
            continue
        file = _expand(candidate)
        looked.append(shown(file))
        if file.is_file():
            return Found(
                files=(SecretFile(key, pod_path, read_file(file, provider), shown(file), pointer),)
            )
    raise missing(provider, looked, fix)


def _gcp(path: str | None) -> Found:
    return _one_file(
        "gcp",
        path,
        [
            os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"),
            "~/.config/gcloud/application_default_credentials.json",
        ],
        "application_default_credentials.json",
        ".config/gcloud/application_default_credentials.json",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS "
        "to a service account key file, or pass path=",
    )


def _kubeconfig(path: str | None) -> Found:
    first = (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or None
    return _one_file(
        "kubeconfig",
        path,
        [first, "~/.kube/config"],
        "config",
        ".kube/config",
        "KUBECONFIG",
        "set KUBECONFIG, create ~/.kube/config, or pass path=",
    )


SSH_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")


def _ssh(path: str | None) -> Found:
    base = _expand(path) if path else _expand("~/.ssh")
    candidates = [base / k for k in SSH_KEYS] if base.is_dir() else [base]
    key = next((c for c in candidates if c.is_file()), None)
    if key is None:
        raise missing(
            "ssh",
            [shown(c) for c in candidates],
            "create a key with `ssh-keygen -t ed25519`, or pass path= (a private key file)",
        )
    files = [SecretFile(key.name, f".ssh/{key.name}", read_file(key, "ssh"), shown(key))]
    public = key.with_name(key.name + ".pub")
    if public.is_file():
        files.append(
            SecretFile(
                public.name,
                f".ssh/{public.name}",
                read_file(public, "ssh"),
                shown(public),
                mode=0o444,
            )
        )
    return Found(files=tuple(files))


def _azure(path: str | None) -> Found:
    names = ("AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID")
    env = {n: v for n in (*names, "AZURE_SUBSCRIPTION_ID") if (v := _from_env((n,)))}
    if path or not all(n in env for n in names):
        raise missing(
            "azure",
            [f"${n}" for n in names],
            "export AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID (a service principal); "
            "path= has no meaning for azure",
        )
    return Found(env=env)


FILES: dict[str, Callable[[str | None], Found]] = {
    "aws": _aws,
    "gcp": _gcp,
    "kubeconfig": _kubeconfig,
    "ssh": _ssh,
    "azure": _azure,
}
PROVIDERS = tuple(sorted({*TOKENS, *FILES}))


def find(provider: str, path: str | None) -> Found:
    """What ``provider``'s preset finds on this machine (``path`` replaces where it looks)."""
    if provider in TOKENS:
        return TOKENS[provider].find(provider, path)
    return FILES[provider](path)
