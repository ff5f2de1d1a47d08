"""Kubetorch's options for naming deployments, which ktlite refuses: it names a deployment
exactly as given (``name=``, else the function's or class's name)."""

from __future__ import annotations

from typing import Any

from ktlite.errors import ConfigError


def check_naming(reload_prefixes: Any, prefix_username: Any) -> None:
    """Refuse ``reload_prefixes`` and ``prefix_username`` (``kt.fn``, ``kt.cls``, ``@kt.compute``)."""
    if reload_prefixes:
        raise ConfigError(
            f"reload_prefixes={reload_prefixes!r}: ktlite names deployments exactly as "
            "given (no user or branch prefixes), so there is nothing to search; pass the "
            "deployment's name with name=..."
        )
    if prefix_username:
        raise ConfigError(
            "prefix_username=True: ktlite never prefixes deployment names with a user "
            "name; put it in name= yourself, e.g. name=f'{user}-train'"
        )
