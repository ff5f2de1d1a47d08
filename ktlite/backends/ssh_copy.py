"""What the ssh backend copies to a host, and how: ktlite's own source and, where the host's
Python lacks them, the pod server's dependencies, each a tar.gz unpacked into the host's
cache (``~/.cache/ktlite``) once per version.

The bytes travel on the SSH connection itself, to the stdin of a Python process started on
the host (``exec``): no SFTP subsystem is needed (an sshd without ``Subsystem sftp`` refuses
one with "Session request failed"), and there is one round trip. The host unpacks into a
staging directory beside the target and renames it into place; the staging directory goes
on every failure, a connection lost mid-copy included (the host's Python then reads a short
stream). Every error names the host (``host K (address):``).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import platform
import shlex
import sys
import tarfile
from pathlib import Path
from typing import Any

import asyncssh

from ktlite.errors import DeployError
from ktlite_server.sshlaunch import SERVER_PACKAGES

COPY_TIMEOUT_S = 300.0

# run on the host by its Python: argv[1] the target directory, argv[2] a staging directory
# beside it; the tar.gz arrives on stdin
UNPACK = """\
import os, shutil, sys, tarfile
target, staging = (os.path.expanduser(p) for p in sys.argv[1:3])
try:
    os.makedirs(staging)
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|gz") as tar:
        tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    open(os.path.join(staging, ".complete"), "w").close()
    try:
        os.rename(staging, target)
    except OSError:
        pass  # another host's copy got there first (a shared home directory)
finally:
    shutil.rmtree(staging, ignore_errors=True)
"""


async def upload(c: Any, target: str, bundle: bytes, timeout: float = COPY_TIMEOUT_S) -> None:
    """Unpack the tar.gz ``bundle`` into ``target`` (``~/...``) on host ``c`` (a connected
    ``ktlite.backends.ssh._Host``); complete only once unpacked."""
    staging = f"{target}.tmp-{os.urandom(4).hex()}"  # hosts may share the home directory
    command = f"{shlex.quote(c.python)} -c {shlex.quote(UNPACK)} {shlex.quote(target)} {shlex.quote(staging)}"
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


def source_bundle() -> tuple[str, bytes]:
    """ktlite's own source (client, server and wire packages) as a tar.gz, and its content
    hash: the hosts run exactly this client's code."""
    import ktlite
    import ktlite_server
    import ktlite_wire

    files: list[tuple[str, Path]] = []
    for pkg in (ktlite, ktlite_server, ktlite_wire):
        root = Path(pkg.__file__).parent
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append((f"{root.name}/{path.relative_to(root)}", path))
    digest = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, path in files:
            data = path.read_bytes()
            digest.update(name.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return digest.hexdigest()[:16], buf.getvalue()


def _closure(names: tuple[str, ...]) -> list[Any]:
    """The installed distributions ``names`` need (their requirements, no extras), here."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - pip's own copy is not importable
        Requirement = None  # noqa: N806
    seen: dict[str, Any] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        for req in dist.requires or []:
            if Requirement is not None:
                r = Requirement(req)
                if r.marker is None or r.marker.evaluate({"extra": ""}):
                    todo.append(r.name)
            elif "extra ==" not in req:
                todo.append(req.split(";")[0].split("[")[0].split()[0].rstrip("<>=!~"))
    return [seen[k] for k in sorted(seen)]


def deps_key() -> str:
    """Which server dependencies this client would ship: their versions, this Python's
    cache tag and the machine (compiled ones, such as pydantic-core, fit only those)."""
    dists = _closure(SERVER_PACKAGES)
    ident = [f"{d.metadata['Name']}=={d.version}" for d in dists]
    ident += [sys.implementation.cache_tag, platform.machine()]
    return hashlib.sha256("\n".join(ident).encode()).hexdigest()[:16]


def deps_bundle() -> bytes:
    """The installed files of the server's dependencies, as a tar.gz of a directory to put on
    ``PYTHONPATH`` (with their metadata: versions are checked there)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for dist in _closure(SERVER_PACKAGES):
            for rel in dist.files or []:
                if rel.parts[0] == ".." or "__pycache__" in rel.parts or rel.suffix == ".pyc":
                    continue
                path = Path(dist.locate_file(rel))
                if path.is_file():
                    tar.add(path, arcname=str(rel), recursive=False)
    return buf.getvalue()
