"""The sandbox of a stand-in cluster's pod process (``kube_harness_pods``): what of this
machine stays visible in it, the user it runs as, the caller's files hidden from it, the
black hole a gone pod's address becomes, and stopping its process group."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def _under(root: Path) -> list[Path]:
    """What this machine runs from (this checkout, its Python) that lies under ``root``."""
    return sorted(
        {
            p
            for p in (
                Path(__file__).resolve().parent.parent,
                Path(sys.prefix).resolve(),
                Path(sys.base_prefix).resolve(),
                Path(sys.executable).resolve().parent,
            )
            if root in p.parents
        }
    )


def _pod_user(pod: dict[str, Any]) -> tuple[int, int, int] | None:
    """(uid, gid, fsGroup) the pod's securityContext asks for, None for root (the image's)."""
    spec = pod["spec"]
    context = {
        **(spec.get("securityContext") or {}),
        **(spec["containers"][0].get("securityContext") or {}),
    }
    uid = context.get("runAsUser")
    if not uid:
        return None
    gid = context.get("runAsGroup", uid)
    return uid, gid, (spec.get("securityContext") or {}).get("fsGroup", gid)


def _as(user: tuple[int, int, int] | None) -> str:
    """The command prefix that runs a pod's processes as its user, with nothing to escalate
    to (as runAsUser, fsGroup, allowPrivilegeEscalation: false and dropped capabilities do)."""
    if user is None:
        return ""
    uid, gid, fs_group = user
    groups = ",".join(str(g) for g in dict.fromkeys((gid, fs_group)))
    return (
        f"setpriv --reuid={uid} --regid={gid} --groups={groups} --no-new-privs "
        "--inh-caps=-all --bounding-set=-all "
    )


def _black_hole(ip: str, port: int) -> tuple[socket.socket, socket.socket]:
    """Make a gone pod's address swallow connection attempts instead of refusing them, as a
    deleted pod's IP does on a real cluster (nothing answers there, not even with a reset): a
    listener that never accepts, its one-slot backlog taken, so the kernel drops new SYNs."""
    hole = socket.socket()
    hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hole.bind((ip, port))
    hole.listen(0)
    filler = socket.socket()
    filler.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        filler.connect(hole.getsockname())
    return hole, filler  # closing either one opens the address again


def _hide_callers_files() -> list[str]:
    """Shell commands that hide the caller's files from a pod, as a real cluster does: an
    empty /tmp (pytest's tmp_path dirs) and an empty tests/ (the test functions' modules), so
    code shipped by value must bring its source along. ktlite itself stays visible (installed
    from outside tests/), and so does tests/old_tarfile (a PYTHONPATH dir pods may be given).
    A checkout or venv that itself lives under /tmp (a CI clone there) stays visible too.
    What stays is bind-mounted to a staging tmpfs on /mnt first and moved back after /tmp
    and tests/ are hidden (all in the pod's own mount namespace). Runs after the PVC binds,
    whose sources live under /tmp."""
    tests = Path(__file__).resolve().parent
    under_tmp = [p for p in (tests.parent, Path(sys.prefix).resolve()) if Path("/tmp") in p.parents]
    roots = [p for p in under_tmp if not any(other in p.parents for other in under_tmp)]
    keep = [*dict.fromkeys(roots), tests / "old_tarfile"]
    cmds = ["mount -t tmpfs tmpfs /mnt"]
    for i, path in enumerate(keep):
        q = shlex.quote(str(path))
        cmds.append(f"if [ -d {q} ]; then mkdir /mnt/{i} && mount --bind {q} /mnt/{i}; fi")

    def back(i: int, path: Path) -> str:
        q = shlex.quote(str(path))
        return f"if [ -d /mnt/{i} ]; then mkdir -p {q} && mount --move /mnt/{i} {q}; fi"

    cmds.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
    cmds += [back(i, path) for i, path in enumerate(keep[:-1])]
    cmds.append(f"mount -t tmpfs tmpfs {shlex.quote(str(tests))}")
    cmds.append(back(len(keep) - 1, keep[-1]))
    return [*cmds, "cd /tmp"]  # the shell's cwd is still the /tmp under the new mount


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass
