"""``kt.secret`` / ``kt.Secret``: credentials the pods get as env vars or files.

A :class:`Secret` only describes where values come from; it reads nothing when made (a
``Compute`` built at import on a pod must not look for the caller's files). Backends call
:func:`resolve` before they create anything, so a preset that finds nothing fails with a
:class:`ConfigError` before any pod starts. Values are held in :class:`Resolved` objects whose
reprs and placeholders name keys, sizes and sources only.

Three forms:

- a provider preset: ``kt.secret(provider="aws")`` or the string ``"aws"`` in
  ``Compute(secrets=[...])`` (presets: ``ktlite.specs.secret_providers.PROVIDERS``);
- values of your own: ``kt.secret(name="db", env_vars={"DB_PASSWORD": pw})``, or
  ``env_vars=["DB_PASSWORD"]`` to read them from this process's environment, or
  ``path="~/.config/tool/creds.json"`` for a file under the home;
- an existing Kubernetes Secret, reused by name: ``kt.secret(name="my-secret")`` or any other
  string in ``Compute(secrets=[...])`` (its keys become env vars, ``envFrom``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ktlite.errors import ConfigError
from ktlite.specs.secret_providers import PROVIDERS, SecretFile, find, read_file, shown
from ktlite.specs.spec import RESERVED_ENV
from ktlite_wire import privatefiles

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")  # a Secret name, and a label value
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# the env vars a file secret points at its file with are the provider's, never the user's
POINTERS = (
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "KUBECONFIG",
)


@dataclass(frozen=True, repr=False)
class Secret:
    """Credentials for every pod: a provider preset, values of your own, or an existing
    Kubernetes Secret. Use :func:`kt.secret` to make one.

    Args:
        name: the secret's name (default: the provider's). Alone, it names an existing
            Kubernetes Secret in the deployment's namespace, reused as it is (a provider's
            name alone means that preset, as in ``Compute(secrets=["aws"])``).
        provider: a preset: aws, azure, anthropic, cohere, gcp, github, huggingface, kubeconfig,
            lambda, langchain, openai, pinecone, ssh, wandb.
        path: where to read instead of the preset's usual place (a file, or for aws and ssh a
            directory); without a provider, a file under your home that the pods get at the same
            place under theirs.
        env_vars: names of env vars to read from this process's environment, or a dict
            ``{NAME: value}``; the pods get them under the same names.
        namespace: the Kubernetes namespace (must be the deployment's: pods can only use
            Secrets of their own namespace).
        override: replace the data of an existing Kubernetes Secret of the same name that this
            deployment did not create (without it, such a clash fails).
    """

    name: str | None = None
    provider: str | None = None
    path: str | None = None
    env_vars: tuple[str, ...] | dict[str, str] | None = None
    namespace: str | None = None
    override: bool = False

    def __post_init__(self) -> None:
        if (
            self.provider is None
            and self.name in PROVIDERS
            and self.path is None
            and self.env_vars is None
        ):
            object.__setattr__(
                self, "provider", self.name
            )  # kt.secret("aws"): the preset, as in a list
            object.__setattr__(self, "name", None)
        if self.provider is not None and self.provider not in PROVIDERS:
            raise ConfigError(
                f"kt.secret(provider={self.provider!r}) is not a known provider; allowed: "
                f"{', '.join(PROVIDERS)} (or give name= and env_vars= / path= for your own)"
            )
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.match(self.name)):
            raise ConfigError(
                f"kt.secret(name={self.name!r}) is not a valid Secret name: use lowercase "
                "letters, digits, '-' and '.', at most 63 characters, e.g. 'db-creds'"
            )
        if self.name is None and self.provider is None:
            raise ConfigError(
                "kt.secret() needs provider= (a preset such as 'aws') or name= (with "
                "env_vars= or path= for values of your own, or alone for an existing "
                "Kubernetes Secret)"
            )
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ConfigError(f"kt.secret(path={self.path!r}) must be a file path string")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.override, bool):
            raise ConfigError(f"kt.secret(override={self.override!r}) must be True or False")
        if self.namespace is not None and (
            not isinstance(self.namespace, str) or not _NAME.match(self.namespace)
        ):
            raise ConfigError(
                f"kt.secret(namespace={self.namespace!r}) is not a valid namespace name"
            )
        self._check_env_vars()
        if self.provider is None and self.path is not None and self.env_vars is not None:
            raise ConfigError(
                f"kt.secret(name={self.name!r}): give path= or env_vars=, not both; "
                "use two secrets for both"
            )

    def _check_env_vars(self) -> None:
        env = self.env_vars
        if env is None:
            return
        if isinstance(env, dict):
            bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
            if bad:  # the names only: a value must never be printed
                raise ConfigError(
                    f"kt.secret(env_vars=...): the values of {bad!r} must be strings "
                    "(names to str values)"
                )
            names = list(env)
            object.__setattr__(self, "env_vars", dict(env))
        elif isinstance(env, (list, tuple)) and all(isinstance(n, str) for n in env):
            names = list(env)
            object.__setattr__(self, "env_vars", tuple(env))
        else:
            raise ConfigError(
                f"kt.secret(env_vars=<{type(env).__name__}>) must be a list of env var names "
                "to read from this environment, or a dict {NAME: value}"
            )
        invalid = [n for n in names if not _ENV.match(n)]
        if invalid or not names:
            raise ConfigError(
                f"kt.secret(env_vars=...): {invalid or 'no name'} — give env var names of "
                "letters, digits and '_', not starting with a digit, e.g. 'DB_PASSWORD'"
            )
        if isinstance(self.env_vars, dict) and any("\0" in v for v in self.env_vars.values()):
            raise ConfigError(
                "kt.secret(env_vars=...): a value holds a NUL character, which no "
                "environment can hold"
            )

    @property
    def key(self) -> str:
        """The secret's own name: ``name``, else the provider's."""
        return self.name or self.provider or ""

    @property
    def existing(self) -> bool:
        """Names an existing Kubernetes Secret, giving no values."""
        return self.provider is None and self.path is None and self.env_vars is None

    def describe(self) -> dict[str, Any]:
        """Everything but values (what pod hashes and reprs see)."""
        env = self.env_vars
        return {
            "name": self.name,
            "provider": self.provider,
            "path": self.path,
            "env_vars": sorted(env) if env is not None else None,
            "namespace": self.namespace,
            "override": self.override,
        }

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.describe().items() if v not in (None, False)]
        return f"Secret({', '.join(parts)})"

    def resolve(self) -> Resolved:
        """Read the values now (this machine's files and env); ConfigError if there are none."""
        return resolve_one(self)


def secret(
    name: str | None = None,
    provider: str | None = None,
    path: str | None = None,
    env_vars: list[str] | tuple[str, ...] | dict[str, str] | None = None,
    namespace: str | None = None,
    override: bool = False,
) -> Secret:
    """Make a :class:`Secret` (Kubetorch's factory).

    Example:
        >>> kt.Compute(cpus=1, secrets=[kt.secret(provider="huggingface"), "aws",
        ...                            kt.secret(name="db", env_vars=["DB_PASSWORD"])])
    """
    # a list goes as it is: Secret's __post_init__ checks it and keeps it as a tuple
    names = cast("tuple[str, ...] | dict[str, str] | None", env_vars)
    return Secret(
        name=name,
        provider=provider,
        path=path,
        env_vars=names,
        namespace=namespace,
        override=override,
    )


def normalize(entries: Any) -> tuple[Secret, ...]:
    """``Compute(secrets=...)`` as Secrets: a preset's name is that preset, any other string
    an existing Kubernetes Secret. ConfigError for other types and for duplicates."""
    if entries is None:
        return ()
    if isinstance(entries, (str, Secret)) or not isinstance(entries, (list, tuple)):
        raise ConfigError(
            f"secrets={entries!r} must be a list, e.g. secrets=['aws', kt.secret(...)]"
        )
    out: list[Secret] = []
    for entry in entries:
        if isinstance(entry, str):
            if entry in PROVIDERS:
                entry = Secret(provider=entry)
            elif not _NAME.match(entry):
                raise ConfigError(
                    f"secrets entry {entry!r} is neither a provider preset ({', '.join(PROVIDERS)}) "
                    "nor a valid Kubernetes Secret name (lowercase letters, digits, '-', '.')"
                )
            else:
                entry = Secret(name=entry)
        elif not isinstance(entry, Secret):
            raise ConfigError(
                f"secrets entry of type {type(entry).__name__} must be a provider name, the "
                "name of an existing Kubernetes Secret, or a kt.secret(...)"
            )
        out.append(entry)
    keys = [s.key for s in out]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ConfigError(
            f"secrets names {', '.join(map(repr, dupes))} more than once; each secret once "
            "(give the second one another name=)"
        )
    return tuple(out)


@dataclass(frozen=True, repr=False)
class Resolved:
    """A secret's values, read: env vars (name -> value) and files; ``existing`` names a
    Kubernetes Secret reused instead (no values)."""

    key: str
    secret: Secret
    env: dict[str, str] = field(default_factory=dict)
    env_sources: dict[str, str] = field(default_factory=dict)
    files: tuple[SecretFile, ...] = ()

    @property
    def existing(self) -> str | None:
        return self.secret.key if self.secret.existing else None

    def data(self) -> dict[str, bytes]:
        """The Kubernetes Secret's data: each env var under its name, each file under its key."""
        return {
            **{k: v.encode() for k, v in self.env.items()},
            **{f.key: f.data for f in self.files},
        }

    def placeholders(self) -> dict[str, str]:
        """What a printed plan shows instead of each value."""
        out = {
            k: f"<redacted: {len(v.encode())} bytes from {self.env_sources.get(k, 'env_vars=')}>"
            for k, v in self.env.items()
        }
        out.update({f.key: f"<redacted: {len(f.data)} bytes from {f.source}>" for f in self.files})
        return out

    def __repr__(self) -> str:
        return f"Resolved({self.key!r}, env={sorted(self.env)}, files={[f.pod_path for f in self.files]})"


def resolve_one(s: Secret) -> Resolved:
    if s.existing:
        return Resolved(s.key, s)
    env: dict[str, str] = {}
    sources: dict[str, str] = {}
    files: tuple[SecretFile, ...] = ()
    if isinstance(s.env_vars, dict):
        env = dict(s.env_vars)
        sources = dict.fromkeys(env, "env_vars=")
    elif s.env_vars is not None:
        absent = [n for n in s.env_vars if not os.environ.get(n)]
        if absent:
            raise ConfigError(
                f"secret {s.key!r}: env var(s) {', '.join(absent)} are not set in this "
                "environment; export them, or pass env_vars={NAME: value}"
            )
        env = {n: os.environ[n] for n in s.env_vars}
        sources = {n: f"${n}" for n in env}
    elif s.provider is not None:
        found = find(s.provider, s.path)
        env = {k: v for k, (v, _) in found.env.items()}
        sources = {k: where for k, (_, where) in found.env.items()}
        files = found.files
    else:
        files = (_own_file(s),)
    return Resolved(s.key, s, env, sources, files)


def _own_file(s: Secret) -> SecretFile:
    """``kt.secret(name=..., path=...)``: a file under the home, put at the same place on pods."""
    file = Path(os.path.expanduser(s.path or "")).absolute()
    home = Path.home()
    if home not in file.parents:
        raise ConfigError(
            f"secret {s.key!r}: path={s.path!r} is not under your home ({home}); pods get a "
            "file secret at the same place under their home, so give a file under yours"
        )
    if not file.is_file():
        raise ConfigError(
            f"secret {s.key!r}: path={s.path!r} is not a file here; give an existing file"
        )
    return SecretFile(
        _file_key(file.name),
        str(file.relative_to(home)),
        read_file(file, s.key),
        shown(file),
        mode=0o400,
    )


def _file_key(name: str) -> str:
    return re.sub(r"[^-._a-zA-Z0-9]", "_", name)


def resolve(
    secrets: tuple[Secret, ...], env: dict[str, str] | None = None, reserved: tuple[str, ...] = ()
) -> list[Resolved]:
    """Every secret's values (ConfigError if a preset finds nothing), checked against each other
    and against the Compute's ``env`` and the names ktlite sets itself."""
    out = [resolve_one(s) for s in secrets]
    owner: dict[str, str] = {}
    paths: dict[str, str] = {}
    for r in out:
        pointers = [f.pointer for f in r.files if f.pointer]
        for name in [*r.env, *pointers]:
            if name in owner:
                raise ConfigError(
                    f"secrets {owner[name]!r} and {r.key!r} both set env var {name}; keep one"
                )
            if name in (env or {}):
                raise ConfigError(
                    f"env={{{name!r}: ...}} and secret {r.key!r} both set {name}; keep one"
                )
            if name in reserved:
                raise ConfigError(
                    f"secret {r.key!r} sets {name}, which ktlite sets itself; use another name"
                )
            owner[name] = r.key
        for f in r.files:
            if f.pod_path in paths:
                raise ConfigError(
                    f"secrets {paths[f.pod_path]!r} and {r.key!r} both put a file at "
                    f"~/{f.pod_path}; keep one"
                )
            paths[f.pod_path] = r.key
        if len({*r.env, *(f.key for f in r.files)}) != len(r.env) + len(r.files):
            raise ConfigError(f"secret {r.key!r}: an env var and a file share a name; rename one")
    return out


def for_pod(
    secrets: tuple[Secret, ...],
    env: dict[str, str],
    backend: str,
    namespace: str | None = None,
    *,
    existing: bool = False,
) -> list[Resolved]:
    """A pod spec's ``secrets`` read for ``backend``, checked against its ``env`` (the image's
    and the user's) and the names ktlite sets: what every backend calls before it makes
    anything. Only a backend with ``existing`` Secrets (kubernetes) reuses them, in the pods'
    own ``namespace``."""
    for s in secrets:
        if s.existing and not existing:
            raise ConfigError(
                f"secrets names {s.key!r}, which is no provider preset; as a Kubernetes Secret's "
                f"name it has no meaning on backend {backend!r}. Use a preset ({', '.join(PROVIDERS)}), "
                f"or kt.secret(name={s.key!r}, env_vars=[...]) with values from this environment"
            )
        if s.namespace is not None and namespace is not None and s.namespace != namespace:
            raise ConfigError(
                f"secret {s.key!r} is in namespace {s.namespace!r}, but the deployment's pods run "
                f"in {namespace!r} and can only use Secrets of their own namespace; leave "
                "namespace= out, or deploy to that namespace"
            )
    return resolve(secrets, env, RESERVED_ENV)


def fingerprint(resolved: list[Resolved], key: str) -> str:
    """A keyed digest of every value (HMAC with the deployment token): pods restart when a
    value changes, and the digest tells nothing about the values."""
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for r in resolved:
        for name, value in sorted(r.data().items()):
            for part in (r.key.encode(), name.encode(), value):
                mac.update(len(part).to_bytes(8, "big") + part)
    return mac.hexdigest()[:16]


def write_files(resolved: list[Resolved], home: Path) -> dict[str, str]:
    """Write every file secret under ``home`` (dirs 0700, files 0600, nothing readable by
    others at any moment); the env vars that point at them (absolute paths)."""
    pointers: dict[str, str] = {}
    privatefiles.make_dir(home)
    for r in resolved:
        for f in r.files:
            target = home / f.pod_path
            target.relative_to(home)  # ValueError for a path that leaves home
            privatefiles.make_dir(target.parent)
            privatefiles.write_file(target, f.data)
            if f.pointer:
                pointers[f.pointer] = str(target)
    return pointers
