"""Kubetorch's spellings of ``kt.Compute``'s keywords, mapped onto ktlite's.

Kubetorch passes None for "not set" on every keyword, may give GPU counts as strings and
names some fields its own way (``env_vars``, ``priority_class_name``, ...). :func:`adapt`
turns such keywords into ktlite's before ``Compute`` sorts them into its parts; nothing of
Kubetorch's is stored.
"""

from __future__ import annotations

from typing import Any

from ktlite.api.kubetorch import LoggingConfig
from ktlite.errors import ConfigError

# Kubetorch's name -> ktlite's
ALIASES = {
    "env_vars": "env",
    "priority_class_name": "priority_class",
    "service_account_name": "service_account",
    "shared_memory_limit": "shared_memory",
}
# Kubetorch's keywords ktlite reads and drops (they map onto others or are refused)
EXTRA = ("logging_config", "selector", "endpoint")


def adapt(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of ``kt.Compute(...)`` in ktlite's own names; raises for Kubetorch's
    features ktlite does not have."""
    # None is "not set" (the default) for every keyword: Compute reads it so; an alias given
    # as None says nothing
    out = {
        k: v for k, v in kwargs.items() if v is not None or (k not in ALIASES and k not in EXTRA)
    }
    for alias, own in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        given = out.get(own)
        if given if own == "env" else given is not None and given != value:
            raise ConfigError(f"pass {own}= or {alias}= (the Kubetorch name), not both")
        out[own] = dict(value) if own == "env" and isinstance(value, dict) else value
    gpus = out.get("gpus")
    if isinstance(gpus, str):
        if not gpus.strip().isdigit():
            raise ConfigError(
                f"gpus={gpus!r} must be a whole number of GPUs such as 1 or '1'; "
                "pick the model with gpu_type=, e.g. gpu_type='NVIDIA-A100-SXM4-80GB'"
            )
        out["gpus"] = int(gpus.strip())
    logging_config = out.pop("logging_config", None)
    if logging_config is not None:
        if not isinstance(logging_config, LoggingConfig):
            raise ConfigError(f"logging_config={logging_config!r} must be a kt.LoggingConfig")
        if logging_config.stream_logs is not None:
            out["stream_logs"] = bool(logging_config.stream_logs)
    for which in ("selector", "endpoint"):
        if out.pop(which, None) is not None:
            raise NotImplementedError(
                f"Compute({which}=...) brings your own pods, which ktlite does not support: ktlite "
                "creates and owns its pods. Give the resources instead (Compute(cpus=, gpus=, image=, "
                "node_selector=...)), or run on existing machines with hosts=[...] (backend='ssh')"
            )
    return out


class KubetorchOperations:
    """Kubetorch's live operations on a Compute's pods. A ktlite Compute describes pods and is
    not bound to a deployment, so each names what to use instead."""

    def _live(self, what: str, instead: str) -> NotImplementedError:
        return NotImplementedError(
            f"compute.{what} is not supported: a ktlite Compute describes pods and "
            f"is not bound to a deployment; {instead}"
        )

    def pip_install(self, *args: Any, **kwargs: Any) -> None:
        raise self._live(
            "pip_install()",
            "put the packages in the image, kt.Image(...).pip_install([...]), "
            "and .to() again (installed at pod start, cached per pod)",
        )

    def run_bash(self, *args: Any, **kwargs: Any) -> None:
        raise self._live(
            "run_bash()",
            "run the command from a function on the pods, e.g. "
            "kt.fn(setup).to(compute), or at pod start with kt.Image(...).run_bash(cmd)",
        )

    def sync_package(self, *args: Any, **kwargs: Any) -> None:
        raise self._live(
            "sync_package()", "ktlite ships the local packages your code imports with every .to()"
        )

    def ssh(self, *args: Any, **kwargs: Any) -> None:
        raise self._live("ssh()", "`kubectl exec -it NAME-0 -- bash` opens a shell in pod 0")

    def pods(self) -> None:
        raise self._live("pods()", "remote.status() lists the deployment's pods and ranks")

    def is_up(self) -> None:
        raise self._live("is_up()", "remote.status() (or `ktlite status NAME`) answers it")

    @classmethod
    def from_manifest(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "Compute.from_manifest() (bring your own manifest) is not supported by ktlite: "
            "ktlite builds its own manifests from kt.Compute's fields (service_template= "
            "merges extra fields into them; `ktlite deploy --dry-run` prints them)"
        )
