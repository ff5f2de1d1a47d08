"""Kubetorch's spellings of ``kt.Compute``'s keywords, mapped onto ktlite's.

Kubetorch passes None for "not set" on every keyword, may give GPU counts as strings and
names some fields its own way (``env_vars``, ``priority_class_name``, ...). :func:`adapt`
turns such keywords into ktlite's before ``Compute`` sorts them into its parts; nothing of
Kubetorch's is stored.
"""

from __future__ import annotations

from typing import Any

from ktlite.errors import ConfigError
from ktlite.kubetorch import LoggingConfig

# Kubetorch's name -> ktlite's
ALIASES = {"env_vars": "env", "priority_class_name": "priority_class",
           "service_account_name": "service_account", "shared_memory_limit": "shared_memory"}
# Kubetorch's keywords ktlite reads and drops (they map onto others or are refused)
EXTRA = ("logging_config", "selector", "endpoint")


def adapt(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of ``kt.Compute(...)`` in ktlite's own names; raises for Kubetorch's
    features ktlite does not have."""
    # None is "not set" (the default) for every keyword: Compute reads it so; an alias given
    # as None says nothing
    out = {k: v for k, v in kwargs.items() if v is not None or (k not in ALIASES and k not in EXTRA)}
    for alias, own in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        given = out.get(own)
        if (given if own == "env" else given is not None and given != value):
            raise ConfigError(f"pass {own}= or {alias}= (the Kubetorch name), not both")
        out[own] = dict(value) if own == "env" and isinstance(value, dict) else value
    gpus = out.get("gpus")
    if isinstance(gpus, str):
        if not gpus.strip().isdigit():
            raise ConfigError(f"gpus={gpus!r} must be a whole number of GPUs such as 1 or '1'; "
                              "pick the model with gpu_type=, e.g. gpu_type='NVIDIA-A100-SXM4-80GB'")
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
                "node_selector=...)), or run on existing machines with hosts=[...] (backend='ssh')")
    return out
