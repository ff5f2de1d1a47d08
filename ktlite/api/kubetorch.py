"""Kubetorch's public names that have no ktlite counterpart of their own.

Each is either what Kubetorch's is (``kt.config``, ``kt.LoggingConfig``'s ``stream_logs``,
``@kt.async_``) or a refusal that names the feature and what to use instead, raised before
anything is deployed: never a silent no-op. README, "Coming from Kubetorch", lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

from ktlite.errors import ConfigError


@dataclass(frozen=True)
class LoggingConfig:
    """Kubetorch's log settings. ``stream_logs`` is honoured (every rank's output comes back
    during calls); the others tune Kubetorch's Loki tailing, which ktlite does not use (its
    pods stream output over the call itself), so only their defaults are accepted."""

    stream_logs: bool | None = None
    level: str = "info"
    include_system_logs: bool = False
    include_events: bool = True
    grace_period: float = 2.0
    include_name: bool = True
    poll_timeout: float = 1.0
    grace_poll_timeout: float = 0.5
    shutdown_grace_period: float = 3.0

    def __post_init__(self) -> None:
        if self.stream_logs is not None and not isinstance(self.stream_logs, bool):
            raise ConfigError(
                f"LoggingConfig(stream_logs={self.stream_logs!r}) must be True or False"
            )
        changed = [
            f.name
            for f in fields(self)
            if f.name != "stream_logs" and getattr(self, f.name) != f.default
        ]
        if changed:
            raise ConfigError(
                f"LoggingConfig({', '.join(f'{n}=...' for n in changed)}) tunes Kubetorch's log "
                "service (Loki), which ktlite does not have: every rank's stdout/stderr streams back "
                "over the call itself, prefixed [rank R @ pod]. Only stream_logs applies; use "
                "remote.logs() for a pod's whole log"
            )


def _refuse(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported by ktlite; {instead}")


_DEBUG_INSTEAD = (
    "a ktlite function is a plain Python function: call it in this process to step "
    "through it, read a rank's output with remote.logs(rank=R), and see what every "
    "rank is doing with remote.status() / `ktlite status NAME`"
)


class DebugConfig:
    """Kubetorch's remote debugger settings: refused (see :data:`_DEBUG_INSTEAD`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("kt.DebugConfig (a remote pdb session on a pod)", _DEBUG_INSTEAD)


def deep_breakpoint(*args: Any, **kwargs: Any) -> None:
    raise _refuse("kt.deep_breakpoint (a remote pdb session on a pod)", _DEBUG_INSTEAD)


class MetricsConfig:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "kt.MetricsConfig (streaming Prometheus metrics during calls)",
            "remote.status() (and `ktlite status NAME --watch`) shows each rank's CPU, "
            "memory, GPU memory and utilisation, read from the pods",
        )


class Endpoint:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "kt.Endpoint (calling pods ktlite did not create)",
            "ktlite creates and owns its pods: give the resources with kt.Compute(...), or "
            "run on machines you already have with kt.Compute(hosts=[...]) (backend='ssh')",
        )


class BroadcastWindow:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "kt.BroadcastWindow (peer-to-peer broadcast of data store transfers)",
            "kt.get(key, dest) from every rank reads from the namespace's store; for tensors "
            "between ranks use torch.distributed.broadcast inside the call",
        )


# Kubetorch's global config keys that ktlite has no meaning for, and why
_KT_ONLY_KEYS = {
    "username": "ktlite names deployments exactly as given (no username prefix); pass name=...",
    "prefix_username": "ktlite never prefixes names with a username",
    "install_namespace": "ktlite installs nothing in the cluster (no controller)",
    "install_url": "ktlite installs nothing in the cluster (no controller)",
    "api_url": "ktlite reaches pods through the API server's pod proxy, from the kubeconfig",
    "cluster_config": "ktlite reads the cluster from the kubeconfig (`ktlite config set kubeconfig`)",
    "stream_metrics": "ktlite streams no metrics; remote.status() shows them",
    "volumes": "give volumes per Compute: kt.Compute(volumes=[...])",
    "stream_logs": "set it per Compute (kt.Compute(stream_logs=False)) or per call "
    "(remote(..., stream_logs=False))",
}


class Config:
    """``kt.config``: Kubetorch's global settings object over ktlite's (``ktlite config``).

    ``kt.config.namespace`` reads a setting; ``kt.config.namespace = "team"`` sets it for this
    process (as an environment override, so pods started from here see it too);
    ``kt.config.set("namespace", "team")`` writes it to ``$KTLITE_HOME/config.json``.
    The module's own functions (``get``, ``read``, ``home``...) stay reachable."""

    def __init__(self, module: ModuleType) -> None:
        object.__setattr__(self, "_module", module)

    def __repr__(self) -> str:
        values = {k: self._module.get(k) for k in sorted(self._module.KEYS)}
        return f"kt.config({', '.join(f'{k}={v!r}' for k, v in values.items() if v is not None)})"

    def _key(self, name: str) -> str:
        key = name.replace("__", ".")  # kt.config.ssh__hosts for "ssh.hosts"
        if key in _KT_ONLY_KEYS:
            raise ConfigError(f"kt.config.{name}: {_KT_ONLY_KEYS[key]}")
        if key not in self._module.KEYS:
            raise AttributeError(
                f"kt.config has no setting {name!r}; settings: "
                f"{', '.join(sorted(self._module.KEYS))}"
            )
        return key

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or hasattr(self._module, name):
            return getattr(self._module, name)
        return self._module.get(self._key(name))

    def __setattr__(self, name: str, value: Any) -> None:
        import os

        key = self._key(name)
        env, allowed, _ = self._module.KEYS[key]
        if value is None:
            os.environ.pop(env, None)
            return
        if allowed is not None and str(value) not in allowed:
            raise ConfigError(
                f"kt.config.{name}={value!r} is not allowed; allowed: {', '.join(allowed)}"
            )
        os.environ[env] = str(value)

    def set(self, key: str, value: Any) -> None:
        """Write ``key`` to the config file (``ktlite config set KEY VALUE``)."""
        if key in _KT_ONLY_KEYS:
            raise ConfigError(f"kt.config.set({key!r}): {_KT_ONLY_KEYS[key]}")
        self._module.set_value(key, str(value))
