"""``python -m ktlite_server.mountns``: start a local pod with its volumes at their mount paths.

Usage: ``python -m ktlite_server.mountns --root DIR [--bind SRC DST]... -- COMMAND...``

In a private mount namespace (inside a user namespace that maps this user to itself when
not root), this builds a new root in a tmpfs mounted on ``DIR``: every entry of ``/`` is
bind-mounted (recursively) there, each ``SRC`` directory is bound at ``DST``, and
directories that a ``DST`` needs but the host lacks are made in that tmpfs (below ``/``)
or in a tmpfs laid over their parent, which gets the parent's own entries bound back.
Then it chroots into the new root, returns to the working directory and execs
``COMMAND`` as this same process: same PID, session and user, so whoever started it
tracks and signals it as before.

Every mount is private to the namespace, so the host's filesystem never changes: a
``DST`` that does not exist on the host does not exist there afterwards either. The new
root itself is read-only (a new name at ``/`` fails instead of vanishing); new names in a
directory laid over by a tmpfs (``/tmp`` for ``/tmp/new/dir``) live in that tmpfs, so the
pod's own temporary files keep working there, seen by the pod alone.
Setuid programs gain no privileges inside a user namespace (``sudo`` does not work).
Failures exit with code 75 and one line on stderr; nothing runs then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import sys

from ktlite_server import logconfig

logger = logging.getLogger(
    "ktlite_server.mountns"
)  # not __name__: this module also runs as __main__
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SETUP_FAILED = 75

_libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """One step of building the namespace failed; the message says which."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise Refused(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    _check(
        _libc.mount(
            source and source.encode(),
            target.encode(),
            fstype and fstype.encode(),
            ctypes.c_ulong(flags),
            data and data.encode(),
        ),
        f"mount {source or ''} on {target} ({fstype or 'flags'} {flags:#x})",
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespace() -> None:
    """A mount namespace of our own whose mounts never propagate back to the host's."""
    uid, gid = os.geteuid(), os.getegid()
    if uid != 0 or _libc.unshare(CLONE_NEWNS) != 0:  # root without CAP_SYS_ADMIN: try a user ns
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user + mount namespace)")
        _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")  # the same user inside and outside
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    # the copied mounts may be shared with the host's (systemd makes / shared): not any more
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def _bind_entry(source: str, target: str, st: os.stat_result, link: str | None) -> None:
    """Recreate one directory entry in a tmpfs: a symlink as itself, anything else bound."""
    if link is not None:
        os.symlink(link, target)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(target)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600))
    _mount(source, target, None, MS_BIND | MS_REC)


class NewRoot:
    """The tree being built on ``root``; paths given to its methods are as the pod sees them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.ours = {"/"}  # directories on a tmpfs of ours (or in a volume): safe to add to

    def at(self, path: str) -> str:
        return self.root + path if path != "/" else self.root

    def build(self) -> None:
        _mount("tmpfs", self.root, "tmpfs", MS_NOSUID, "mode=0755")
        # the entry holding our root first: its recursive bind then copies few mounts
        top = "/" + os.path.relpath(self.root, "/").split("/")[0]
        for name in sorted(os.listdir("/"), key=lambda n: "/" + n != top):
            source = "/" + name
            st = os.lstat(source)
            link = os.readlink(source) if stat.S_ISLNK(st.st_mode) else None
            _bind_entry(source, self.root + source, st, link)

    def _overlay(self, path: str) -> None:
        """Lay a tmpfs over the host directory ``path`` with its entries bound back, so that
        new names can be made in it without touching the host."""
        where = self.at(path)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)  # still reaches what the tmpfs covers
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            _mount("tmpfs", where, "tmpfs", MS_NOSUID, f"mode={mode:04o}")
            for name in os.listdir(fd):
                st = os.lstat(name, dir_fd=fd)
                link = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
                _bind_entry(f"/proc/self/fd/{fd}/{name}", f"{where}/{name}", st, link)
        finally:
            os.close(fd)
        self.ours.add(path)

    def make_dirs(self, path: str) -> None:
        """``path`` as a directory, making the missing parts in tmpfs only."""
        current = "/"
        for part in path.strip("/").split("/"):
            child = os.path.join(current, part)
            if not os.path.lexists(self.at(child)):
                if current not in self.ours:
                    self._overlay(current)
                os.mkdir(self.at(child), 0o755)
                self.ours.add(child)
            elif not os.path.isdir(self.at(child)):
                raise Refused(f"{child} exists on this machine and is not a directory")
            current = child

    def bind(self, source: str, path: str) -> None:
        self.make_dirs(path)
        _mount(source, self.at(path), None, MS_BIND | MS_REC)
        self.ours.add(path)  # a volume nested in this one gets its mount point in the volume

    def enter(self) -> None:
        """Seal the new root read-only, chroot into it, go back to the same directory."""
        _mount(None, self.root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        cwd = os.getcwd()
        os.chroot(self.root)
        try:
            os.chdir(cwd)
        except OSError:
            os.chdir("/")
        # the recursive bind of the entry holding ``root`` copied our tmpfs there too: drop it
        for _ in range(8):
            if _libc.umount2(self.root.encode(), MNT_DETACH) != 0:
                break


def setup(root: str, binds: list[tuple[str, str]]) -> None:
    enter_namespace()
    tree = NewRoot(os.path.abspath(root))
    tree.build()
    # real paths as the host resolves them (/bin/x is /usr/bin/x); outer mounts first
    targets = [(os.path.abspath(src), os.path.realpath(dst)) for src, dst in binds]
    for source, target in sorted(targets, key=lambda t: t[1].count("/")):
        tree.bind(source, target)
    tree.enter()


def _parse(argv: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    if "--" not in argv:
        raise SystemExit(
            "usage: python -m ktlite_server.mountns --root DIR [--bind SRC DST]... -- COMMAND..."
        )
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1 :]
    root, binds = "", []
    i = 0
    while i < len(opts):
        if opts[i] == "--root" and i + 1 < len(opts):
            root, i = opts[i + 1], i + 2
        elif opts[i] == "--bind" and i + 2 < len(opts):
            binds.append((opts[i + 1], opts[i + 2]))
            i += 3
        else:
            raise SystemExit(f"mountns: unexpected argument {opts[i]!r}")
    if not root or not command:
        raise SystemExit("mountns: --root and a COMMAND are required")
    return root, binds, command


def main() -> None:
    logconfig.configure()
    root, binds, command = _parse(sys.argv[1:])
    try:
        setup(root, binds)
    except (Refused, OSError) as e:
        logger.error(
            "could not give this local pod its volumes in a private mount namespace: %s", e
        )
        sys.exit(SETUP_FAILED)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
