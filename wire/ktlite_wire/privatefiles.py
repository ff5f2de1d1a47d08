"""Private files: what ktlite writes on a machine is for its user alone (stdlib only).

Every directory ktlite makes (``$KTLITE_HOME`` and what is under it on the caller; a pod's
run, cache and scratch directories) is mode 0700, every file 0600, whatever the umask. A file
is written whole: into a fresh temporary name in its own directory (``O_EXCL``, never
following a link), then renamed into place, so a reader sees the old or the new content and a
link planted at a predictable name is never written through. The caller, the pod server and
the rank processes all use this module (it is in ``ktlite_wire`` so each can).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
_OPEN_FLAGS = os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

StrPath = str | os.PathLike[str]


def make_dir(path: StrPath) -> bool:
    """Make ``path`` (and any missing parent) a directory of mode 0700; an existing one
    that others can read or enter is tightened to 0700. Returns whether it was tightened
    (callers say so in their log)."""
    path = Path(path)
    missing: list[Path] = []
    here = path
    while not here.exists():
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(d, DIR_MODE)
            os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask; this one is exact
    return tighten(path)


def tighten(path: StrPath) -> bool:
    """Take group and other permissions off ``path`` (a file or directory of this user's, not
    followed when it is a link; another user's, such as a volume a pod is given, stays as it
    is); returns whether it had any."""
    st = os.stat(path, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077 or st.st_uid != os.geteuid():
        return False
    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
    return True


def tighten_tree(root: StrPath, skip: tuple[str, ...] = ()) -> int:
    """:func:`tighten` everything under ``root`` (links are not followed; the top-level
    entries named in ``skip`` are left as they are, with what they hold); returns how many
    entries had group or other permissions."""
    count, top = 0, os.fspath(root)
    for here, dirs, files in os.walk(top):
        if here == top:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in (*dirs, *files):
            # gone meanwhile, or another user's (which stays as it is)
            with contextlib.suppress(FileNotFoundError, PermissionError):
                count += tighten(os.path.join(here, name))
    return count


def write_file(path: StrPath, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (mode 0600) whole: a fresh temporary file in the same
    directory, renamed over ``path``. The directory must exist."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_append(path: StrPath) -> BinaryIO:
    """``path`` opened to append bytes (a log): made 0600, an older one tightened to 0600; a
    link at ``path`` is refused (OSError), never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | _OPEN_FLAGS, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def create_new(path: StrPath) -> BinaryIO:
    """A new file at ``path`` (mode 0600) opened to write bytes; FileExistsError if anything,
    a link included, is there already."""
    fd = os.open(path, os.O_WRONLY | os.O_EXCL | _OPEN_FLAGS, FILE_MODE)
    return os.fdopen(fd, "wb")


def scratch_dir(prefix: str, parent: StrPath | None = None) -> str:
    """A fresh directory (mode 0700, an unpredictable name) for a process's own files."""
    return tempfile.mkdtemp(prefix=prefix, dir=parent)
