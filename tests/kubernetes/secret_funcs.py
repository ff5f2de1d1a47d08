"""What the secrets tests run on pods (shipped by value: this module is not installed there)."""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any


def digest(text: str | bytes | None) -> str | None:
    """A value's sha256: what ranks return instead of a secret (results get printed)."""
    if text is None:
        return None
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def read_secrets(env_names: list[str], files: list[str]) -> dict[str, Any]:
    """Each env var's digest, and each file's (``~`` is the pod's home): its digest, its mode,
    and whether its directory is writable (a subPath mount leaves ~/.ssh writable)."""
    out: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "0")),
        "home": os.path.expanduser("~"),
    }
    out["env"] = {name: digest(os.environ.get(name)) for name in env_names}
    out["files"] = {}
    for name in files:
        path = os.path.expanduser(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError as e:
            out["files"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out["files"][name] = {
            "digest": digest(data),
            "mode": oct(mode),
            "path": path,
            "dir_writable": os.access(os.path.dirname(path), os.W_OK),
        }
    out["pointers"] = {
        k: os.environ.get(k)
        for k in (
            "AWS_SHARED_CREDENTIALS_FILE",
            "AWS_CONFIG_FILE",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "KUBECONFIG",
        )
    }
    return out
