"""ktlite's own source as it travels to the machines that run it: the SSH backend's hosts and
Kubernetes pods, whose Python need not have ktlite (and is never sent to a package index for it).

The bundle is a tar.gz of the ``ktlite``, ``ktlite_server`` and ``ktlite_wire`` packages' ``.py``
files, named for its :data:`DIGEST` (every file's path and SHA-256; ``__pycache__`` aside);
likewise the installed files of the pod server's own dependencies (:func:`deps_bundle`), for a
far side whose Python lacks them and matches this one (compiled packages fit only it).
:data:`UNPACK` is the Python the far side runs to unpack it (standard library only, as it runs
before ktlite is there): into a staging directory beside the target, checked against the
digest, then renamed into place; a target already there with that digest is kept.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ktlite.backends.server_source import client_root, server_packages, server_root, wire_root

# the digest of a directory tree, in the host's Python (which may lack ktlite) and here: every
# regular file's path and SHA-256, sorted; anything else (a link, a fifo) makes it "!", which no
# copy is named for. __pycache__ directories are the host Python's own and do not count.
DIGEST = """\
import hashlib, os, stat
def tree_digest(root):
    lines = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            path = os.path.join(here, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return "!"
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            lines.append(rel + "\\0" + h.hexdigest())
    return hashlib.sha256("\\n".join(sorted(lines)).encode()).hexdigest()[:32]
"""

# run on the host by its Python: argv[1] the target directory, argv[2] a staging directory
# beside it, argv[3] the digest the copy must have; the tar.gz arrives on stdin. A target that
# is there already with another digest (changed, or cut short) is replaced.
UNPACK = (
    DIGEST
    + """\
import shutil, sys, tarfile
target, staging = (os.path.expanduser(p) for p in sys.argv[1:3])
want = sys.argv[3]
os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
os.chmod(os.path.dirname(target), 0o700)
try:
    os.mkdir(staging, 0o700)
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|gz") as tar:
        tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    got = tree_digest(staging)
    if got != want:
        sys.exit(f"the copy unpacked with digest {got}, not the {want} it was sent with")
    try:
        os.rename(staging, target)
    except OSError:  # there already: another host's copy (a shared home), or a spoilt one
        if tree_digest(target) != want:
            spoilt = staging + "-spoilt"
            os.rename(target, spoilt)
            os.rename(staging, target)
            shutil.rmtree(spoilt, ignore_errors=True)
finally:
    shutil.rmtree(staging, ignore_errors=True)
"""
)


def files_digest(files: list[tuple[str, bytes]]) -> str:
    """:data:`DIGEST` of the tree that ``files`` ((path, content) pairs) unpack to."""
    lines = [f"{name}\0{hashlib.sha256(data).hexdigest()}" for name, data in files]
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:32]


@cache
def source_bundle() -> tuple[str, bytes]:
    """ktlite's own source (client, server and wire packages) as a tar.gz, and its
    :data:`DIGEST`: the hosts and pods run exactly this client's code (read once per
    process)."""
    files: list[tuple[str, bytes]] = []
    for root in (client_root(), server_root(), wire_root()):
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append((f"{root.name}/{path.relative_to(root)}", path.read_bytes()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return files_digest(files), buf.getvalue()


def closure(names: tuple[str, ...]) -> list[Any]:
    """The installed distributions ``names`` need (their requirements, no extras), here."""
    from importlib import metadata

    parse: Callable[[str], Any] | None
    try:
        from packaging.requirements import Requirement as parse
    except ImportError:  # pragma: no cover - pip's own copy is not importable
        parse = None
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
            if parse is not None:
                r = parse(req)
                if r.marker is None or r.marker.evaluate({"extra": ""}):
                    todo.append(r.name)
            elif "extra ==" not in req:
                todo.append(req.split(";")[0].split("[")[0].split()[0].rstrip("<>=!~"))
    return [seen[k] for k in sorted(seen)]


def deps_closure() -> list[Any]:
    """The installed distributions the pod server's packages are, with all they need."""
    return closure(server_packages())


def _deps_files() -> list[tuple[str, Path]]:
    """The server's dependencies' installed files: (path in the copy, path here)."""
    out = []
    for dist in deps_closure():
        for rel in dist.files or []:
            if rel.parts[0] == ".." or "__pycache__" in rel.parts or rel.suffix == ".pyc":
                continue
            path = Path(dist.locate_file(rel))
            if path.is_file():
                out.append((rel.as_posix(), path))
    return out


def deps_digest() -> str:
    """The :data:`DIGEST` of :func:`deps_bundle`'s copy (the files are read, not packed; the
    copy is named for it: compiled packages fit only this Python and machine, and their file
    names say which)."""
    return files_digest([(name, path.read_bytes()) for name, path in _deps_files()])


def deps_bundle() -> bytes:
    """The installed files of the server's dependencies, as a tar.gz of a directory to put on
    ``PYTHONPATH`` (with their metadata: versions are checked there)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, path in _deps_files():
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
