"""Unpack a ``kt.app`` working directory (the archive :func:`ktlite.api.apps.pack` makes) on a
pod, refusing any member that could be written, or point, outside the destination folder.

``tarfile``'s ``data`` extraction filter (PEP 706) exists from Python 3.12, 3.11.4 and 3.10.12
on; the older patch releases ktlite supports (Debian 12's Python 3.11.2, for one) have neither
the filter nor ``extractall(filter=...)``. So every archive is checked here first, the same way
on every Python (:func:`check_members`), then extracted by ``tarfile`` with the ``data``
filter where there is one, else by :func:`_write`, which needs nothing newer than 3.10.

The check is stricter than the filter, never looser, and refuses nothing ``pack()`` makes from
a folder whose links stay inside it:

- names: relative, without ``..``, each at most once, none below a symbolic link of the
  archive (``lnk/file`` would be written wherever ``lnk`` points);
- types: regular files, folders, symbolic and hard links; no devices, FIFOs or other specials;
- symbolic links: relative, and the target stays inside without passing through another
  symbolic link of the archive (``a -> b/..`` with ``b -> .`` would end outside);
- hard links: to a regular file earlier in the archive (written here as a copy of it).

As with the ``data`` filter, modes lose set-uid/set-gid/sticky and group/other write bits, and
owners are not restored.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Sequence

from ktlite.errors import ConfigError
from ktlite_wire import privatefiles

_NOT_PACKED = "kt.app's pack() never makes such a member: was the archive made elsewhere?"
_LINK_FIX = (
    "a link in the working directory must point inside it, by a relative path: replace "
    "it with a copy of what it points to, or pass kt.app(..., workdir=) a folder that "
    "holds both"
)


def _refused(member: tarfile.TarInfo, why: str, fix: str = _NOT_PACKED) -> ConfigError:
    return ConfigError(
        f"refusing to unpack the working directory: member {member.name!r} {why}; {fix}"
    )


def _normal(path: str) -> str | None:
    """``path`` as ``a/b`` (no ``.``, no empty parts), or None if it is absolute or has ``..``."""
    if path.startswith("/") or os.path.isabs(path):
        return None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return None if ".." in parts else "/".join(parts)


def _kind(member: tarfile.TarInfo) -> str:
    if member.ischr() or member.isblk():
        return "device node"
    if member.isfifo():
        return "FIFO"
    return f"special file (tar type {member.type!r})"


def _first_symlink(parts: list[str], symlinks: set[str]) -> str | None:
    """The first of ``a``, ``a/b``, ... (for parts [a, b, ...]) that is a symbolic link."""
    return next(
        (p for p in ("/".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in symlinks), None
    )


def _check_symlink(member: tarfile.TarInfo, name: str, symlinks: set[str]) -> None:
    link = member.linkname
    if not link:
        raise _refused(member, "is a symbolic link to nothing")
    if link.startswith("/") or os.path.isabs(link):
        raise _refused(member, f"is a symbolic link to the absolute path {link!r}", _LINK_FIX)
    # walk the target from the link's folder, as the kernel will; a step through another
    # link of the archive would continue from wherever that one points, so none is allowed
    at = name.split("/")[:-1]
    steps = [s for s in link.split("/") if s not in ("", ".")]
    for i, step in enumerate(steps):
        if step != "..":
            at.append(step)
        elif at:
            at.pop()
        else:
            raise _refused(
                member, f"is a symbolic link to {link!r}, outside the destination", _LINK_FIX
            )
        if i < len(steps) - 1 and "/".join(at) in symlinks:
            raise _refused(
                member,
                f"is a symbolic link to {link!r}, which passes through the "
                f"symbolic link {'/'.join(at)!r}",
            )


def check_members(members: Sequence[tarfile.TarInfo]) -> None:
    """Raise :class:`ConfigError` naming the first member that breaks a rule of this module's
    docstring. Needs the whole list: a link later in the archive changes what an earlier
    name or link means."""
    names = [_normal(m.name) for m in members]
    symlinks = {n for m, n in zip(members, names, strict=True) if n and m.issym()}
    seen: dict[str, tarfile.TarInfo] = {}
    for member, name in zip(members, names, strict=True):
        if member.name.startswith("/") or os.path.isabs(member.name):
            raise _refused(member, "has an absolute path")
        if name is None:
            raise _refused(
                member, "has '..' in its path, which could reach outside the destination"
            )
        if not name:  # "." (tar's name for the folder it was run in): the destination itself
            if member.isdir():
                continue
            raise _refused(member, "names the destination folder itself")
        if name in seen:  # a second copy would replace the first after it was checked
            raise _refused(member, "appears twice in the archive")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise _refused(member, f"is a {_kind(member)}, which a working directory cannot ship")
        through = _first_symlink(name.split("/")[:-1], symlinks)
        if through is not None:
            raise _refused(
                member,
                f"lies below the symbolic link {through!r}, so it would be "
                "written wherever that points",
            )
        if member.issym():
            _check_symlink(member, name, symlinks)
        elif member.islnk():
            target = seen.get(_normal(member.linkname) or "")
            if target is None or not target.isreg():
                raise _refused(
                    member,
                    f"is a hard link to {member.linkname!r}, which is not a "
                    "regular file earlier in the archive",
                )
        seen[name] = member


def _file_mode(member: tarfile.TarInfo) -> int:
    """The ``data`` filter's mode for a file: no set-id, sticky or group/other write bits;
    owner read/write always; execute bits only where the owner's is set."""
    mode = member.mode & 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _write(tar: tarfile.TarFile, members: Sequence[tarfile.TarInfo], root: str) -> None:
    """Extract checked ``members`` under ``root`` (a resolved path) without ``filter=``."""
    regular = {_normal(m.name): m for m in members if m.isreg()}
    for member in members:
        path = os.path.join(root, _normal(member.name) or "")
        parent = os.path.dirname(path)
        # the archive cannot lead outside (checked), but a folder that was not empty could
        if os.path.commonpath([os.path.realpath(parent), root]) != root:
            raise _refused(
                member,
                f"would be written outside {root} through a link already there",
                "unpack into an empty folder",
            )
        os.makedirs(parent, exist_ok=True)
        if member.isdir():
            os.makedirs(path, exist_ok=True)  # modes of folders are not kept, as with the filter
        elif member.issym():
            os.symlink(member.linkname, path)
        else:
            source = tar.extractfile(
                regular[_normal(member.linkname)] if member.islnk() else member
            )
            assert source is not None  # a regular file (or a hard link to one) always has data
            # never through something already at that name (O_EXCL, O_NOFOLLOW)
            with privatefiles.create_new(path) as out, source:
                shutil.copyfileobj(source, out)
            os.chmod(path, _file_mode(member))
            os.utime(path, (member.mtime, member.mtime))


def extract(blob: bytes, dest: str | os.PathLike[str]) -> None:
    """Unpack the gzipped tar ``blob`` into the empty folder ``dest``, refusing the whole
    archive (before writing anything) if a member breaks a rule of this module's docstring."""
    root = os.path.realpath(dest)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = tar.getmembers()
        check_members(members)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, members=members, filter="data")
        else:
            _write(tar, members, root)
