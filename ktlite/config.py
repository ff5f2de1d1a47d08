"""User settings in ``$KTLITE_HOME/config.json`` (default ``~/.ktlite``): ``ktlite config``.

Precedence everywhere: an explicit argument (``kt.Compute(backend=...)``), then the
environment (``KTLITE_BACKEND``, ...), then this file, then the built-in default.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ktlite.errors import ConfigError
from ktlite_wire import privatefiles

logger = logging.getLogger(__name__)

# key → (environment variable, allowed values or None, what it is)
KEYS: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "backend": ("KTLITE_BACKEND", ("local", "kubernetes", "ssh"), "where pods run"),
    "namespace": (
        "KTLITE_NAMESPACE",
        None,
        "Kubernetes namespace (default: the kubeconfig context's)",
    ),
    "kubeconfig": (
        "KTLITE_KUBECONFIG",
        None,
        "kubeconfig file (default: KUBECONFIG, ~/.kube/config)",
    ),
    "context": ("KTLITE_CONTEXT", None, "kubeconfig context (default: the current one)"),
    "image": ("KTLITE_IMAGE", None, "default pod image when Compute has none"),
    "image_pull_policy": (
        "KTLITE_IMAGE_PULL_POLICY",
        ("Always", "IfNotPresent", "Never"),
        "default imagePullPolicy",
    ),
    "install": ("KTLITE_INSTALL", None, "pip spec installed in images without ktlite"),
    "keep_failed": (
        "KTLITE_KEEP_FAILED",
        ("true", "false"),
        "keep what a failed first deploy created, to inspect it (default: remove it)",
    ),
    "ssh.hosts": (
        "KTLITE_SSH_HOSTS",
        None,
        "the ssh backend's machines, comma-separated, when a Compute names none",
    ),
}


# the built-in value of a key, where one is fixed (the others depend on the cluster or image)
DEFAULTS = {"backend": "local"}


def home() -> Path:
    """``$KTLITE_HOME`` (default ``~/.ktlite``); nothing is created (:func:`private_home`)."""
    return Path(os.environ.get("KTLITE_HOME") or Path.home() / ".ktlite")


def private_home() -> Path:
    """:func:`home`, made a directory of mode 0700 if it is not one: everything ktlite keeps
    under it (deployments, pod logs, the local store, the SSH caches, secrets) is its user's
    alone. A home an older ktlite left open to others is tightened, with what it holds, and
    a warning says so."""
    path = home()
    try:
        tightened = privatefiles.make_dir(path)
    except PermissionError as e:  # another user's directory: it stays as it is
        logger.warning("ktlite: cannot make %s private (%s); its modes stay as they are", path, e)
        return path
    if tightened:
        # what it holds is made private too (not the volumes' contents: the user's own data)
        count = privatefiles.tighten_tree(path, skip=("volumes",))
        logger.warning(
            "ktlite: %s was open to other users; made it private (mode 0700), and %d "
            "files and directories in it (0600/0700)",
            path,
            count,
        )
    return path


def private_dir(*parts: str) -> Path:
    """A directory under :func:`private_home` (made, mode 0700)."""
    path = private_home().joinpath(*parts)
    privatefiles.make_dir(path)
    return path


def _path() -> Path:
    return home() / "config.json"


def _check_key(key: str) -> None:
    if key not in KEYS:
        raise ConfigError(f"config key {key!r} is not known; allowed: {', '.join(sorted(KEYS))}")


def read() -> dict[str, str]:
    try:
        with open(_path()) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_path()} is not valid JSON ({e}); fix or delete it") from e
    return {k: str(v) for k, v in data.items() if k in KEYS}


def get(key: str) -> str | None:
    """The effective value: environment first, then the config file."""
    _check_key(key)
    env = os.environ.get(KEYS[key][0])
    return env if env else read().get(key)


def origin(key: str) -> tuple[str | None, str]:
    """The effective value of ``key`` and where it comes from: the environment, the config
    file, the built-in default, or nowhere (then the value is None and the text is the key's
    description, which says what applies instead)."""
    _check_key(key)
    env, _, what = KEYS[key]
    if os.environ.get(env):
        return os.environ[env], f"from {env}"
    saved = read()
    if key in saved:
        return saved[key], f"from the config file {_path()}"
    if key in DEFAULTS:
        return DEFAULTS[key], f"the default (set it with `ktlite config set {key} ...` or {env})"
    return None, what


def set_value(key: str, value: str) -> None:
    _check_key(key)
    allowed = KEYS[key][1]
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: {', '.join(allowed)}")
    _write({**read(), key: value})


def unset(key: str) -> None:
    _check_key(key)
    data = read()
    data.pop(key, None)
    _write(data)


def _write(data: dict[str, Any]) -> None:
    privatefiles.write_file(
        private_home() / "config.json", json.dumps(data, indent=2, sort_keys=True) + "\n"
    )
