"""Where the pod server's source lives, found without importing it.

The ssh backend ships ktlite's own source to its hosts and installs the pod server's
dependencies there. The client never imports ``ktlite_server`` for that: it finds the package
with :func:`importlib.util.find_spec` and reads the dependency list from
``ktlite_server/packages.py`` as text (the one place it is written).
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

from ktlite.errors import ConfigError

SERVER = "ktlite_server"
WIRE = "ktlite_wire"


def server_root() -> Path:
    """The directory of the ``ktlite_server`` package (not imported)."""
    return _package_root(SERVER)


def wire_root() -> Path:
    """The directory of the ``ktlite_wire`` package (the wire contract both sides share)."""
    return _package_root(WIRE)


def _package_root(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(
            f"the package {package!r} is not installed next to ktlite; reinstall "
            "ktlite (pip install ktlite), which ships it"
        )
    return Path(locations[0])


def client_root() -> Path:
    """The directory of the ``ktlite`` package."""
    return Path(__file__).resolve().parents[1]


@cache
def server_packages() -> tuple[str, ...]:
    """``SERVER_PACKAGES`` of ``ktlite_server/packages.py``: the distributions the pod server
    needs on a host, read from the source without running it."""
    path = server_root() / "packages.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SERVER_PACKAGES" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
                return value
    raise ConfigError(
        f"{path} defines no SERVER_PACKAGES tuple of strings; the ktlite installation is "
        "damaged: reinstall it"
    )
