"""What the ssh backend copies to a host, and how: ktlite's own source and, where the host's
Python lacks them, the pod server's dependencies, each a tar.gz unpacked into the host's
cache (``~/.cache/ktlite``, mode 0700) once per content (the bundles and their digests are
:mod:`ktlite.backends.shipped_source`'s, shared with the Kubernetes pods).

Each copy is named for the digest of what it holds (:data:`DIGEST`: every file's path and
SHA-256; ``__pycache__`` aside) and checked against it before it is reused and right after it
is unpacked: a copy that was changed, or lost a file, or gained one, is shipped again.

The bytes travel on the SSH connection itself, to the stdin of a Python process started on
the host (``exec``): no SFTP subsystem is needed (an sshd without ``Subsystem sftp`` refuses
one with "Session request failed"), and there is one round trip. The host unpacks into a
staging directory beside the target and renames it into place; the staging directory goes
on every failure, a connection lost mid-copy included (the host's Python then reads a short
stream). Every error names the host (``host K (address):``).
"""

from __future__ import annotations

import asyncio
import os
import shlex
from typing import Any

import asyncssh

from ktlite.backends.shipped_source import (
    DIGEST,
    UNPACK,
    deps_bundle,
    deps_digest,
    files_digest,
    source_bundle,
)
from ktlite.errors import DeployError

COPY_TIMEOUT_S = 300.0
__all__ = [
    "DIGEST",
    "UNPACK",
    "files_digest",
    "source_bundle",
    "deps_bundle",
    "deps_digest",
    "upload",
    "verify_code",
]


def verify_code(copies: dict[str, tuple[str, str]]) -> str:
    """Python for the host that prints ``KTLITE_OK_<name>`` for each of ``copies`` (name ->
    (directory, digest)) whose directory holds exactly that digest."""
    return (
        DIGEST
        + f"for _n, (_d, _w) in {copies!r}.items():\n"
        + "    _d = os.path.expanduser(_d)\n"
        + "    if os.path.isdir(_d) and tree_digest(_d) == _w: print('KTLITE_OK_' + _n)\n"
    )


async def upload(
    c: Any, target: str, bundle: bytes, digest: str, timeout: float = COPY_TIMEOUT_S
) -> None:
    """Unpack the tar.gz ``bundle`` into ``target`` (``~/...``) on host ``c`` (a connected
    ``ktlite.backends.ssh._Host``); complete only once unpacked with ``digest``
    (:data:`DIGEST`), replacing whatever ``target`` held."""
    staging = f"{target}.tmp-{os.urandom(4).hex()}"  # hosts may share the home directory
    args = " ".join(shlex.quote(a) for a in (UNPACK, target, staging, digest))
    command = f"{shlex.quote(c.python)} -c {args}"
    what = f"copying {len(bundle) >> 10} KiB of ktlite's files into {target} over SSH"
    try:
        result = await asyncio.wait_for(
            c.conn.run(command, input=bundle, encoding=None, check=False), timeout
        )
    except asyncio.TimeoutError:
        raise DeployError(
            f"{c.label}: {what} took over {timeout:.0f}s; check the link to the host"
        ) from None
    except (asyncssh.Error, OSError) as e:
        raise DeployError(
            f"{c.label}: {what} failed: {type(e).__name__}: {e}; the host must let this "
            "user run commands over SSH (it runs the pod server the same way)"
        ) from None
    if result.exit_status != 0:
        err = (result.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise DeployError(
            f"{c.label}: {what} failed (exit {result.exit_status}): {err or 'no output'}"
        )
