"""The packages the pod server needs besides ktlite's own code, and which of them a Python
lacks. Standard library only: asked before the server (and they) can be imported, by the
Kubernetes pods' entry point (``boot``) and on SSH hosts (``sshlaunch``); the client reads
:data:`SERVER_PACKAGES` from this file as text (``ktlite.backends.server_source``)."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_PACKAGES = ("fastapi", "uvicorn", "httptools", "httpx", "cloudpickle", "prometheus_client")


def missing_here(pins: dict[str, str]) -> list[str]:
    """The server's packages this Python cannot import, or has at another version than
    pinned."""
    import importlib.metadata
    import importlib.util

    def bad(package: str) -> bool:
        if importlib.util.find_spec(package) is None:
            return True
        try:
            return package in pins and importlib.metadata.version(package) != pins[package]
        except importlib.metadata.PackageNotFoundError:
            return True

    return [p for p in SERVER_PACKAGES if bad(p)]


def missing_in(python: str, pins: dict[str, str]) -> list[str]:
    """:func:`missing_here` for ``python`` (in this process when it is this Python)."""
    if python == sys.executable:
        return missing_here(pins)
    code = "import json, sys; from ktlite_server.packages import missing_here; print(*missing_here(json.loads(sys.argv[1])))"
    out = subprocess.run(
        [python, "-c", code, json.dumps(pins)], capture_output=True, text=True, timeout=60
    )
    return out.stdout.split()
