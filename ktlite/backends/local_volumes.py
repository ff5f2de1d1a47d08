"""Volumes of local pods: a ``kt.Volume`` is a directory that outlives its deployment.

The volume called N is ``$KTLITE_HOME/volumes/N`` (default ``~/.ktlite``), whichever
deployment names it (two deployments naming it share it, like a ReadWriteMany PVC), and
a volume given by name (an existing PVC's) is the directory of that name. The deployment
whose ``kt.Volume`` made the directory owns it (``N.owner`` beside it, as a PVC carries
its deployment's label): ``teardown(volumes=True)`` of that deployment deletes it; nothing
else does.

Every pod sees the directory at its ``mount_path`` where this machine gives ktlite a private
mount namespace (Linux, as root or with unprivileged user namespaces; probed once per
process): ``ktlite_server.mountns`` arranges it there, and the host's own directories never
change. Elsewhere, or with ``KTLITE_LOCAL_MOUNTS=0``, nothing is mounted. Either way each
pod's environment has ``KTLITE_VOLUME_<NAME>``: where the volume's data is for that pod.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from ktlite.config import home as config_home
from ktlite.config import private_home
from ktlite.errors import ConfigError
from ktlite.specs.podspec import PodSpec
from ktlite.specs.volume import Volume
from ktlite_wire import privatefiles

_NO_MOUNTS_UNDER = ("/proc", "/sys", "/dev")  # kernel trees: ktlite never lays a tmpfs over them
_probed: tuple[bool, str] | None = None


def ktlite_home() -> Path:
    return config_home().absolute()


def volumes_root() -> Path:
    return ktlite_home() / "volumes"


@dataclass(frozen=True)
class LocalVolume:
    """One volume of a local pod: its name, where pods expect it, whether a ``kt.Volume``
    declared it (else it names an existing PVC), and the directory that holds its data."""

    name: str
    mount_path: str
    declared: bool

    @property
    def source(self) -> Path:
        return volumes_root() / self.name

    @property
    def env_name(self) -> str:
        return "KTLITE_VOLUME_" + self.name.upper().replace("-", "_")


def local_volumes(pod: PodSpec) -> list[LocalVolume]:
    """The Compute's volumes; ConfigError for a mount path local pods cannot have."""
    out = []
    home = str(ktlite_home())
    for vol in pod.volumes:
        if isinstance(vol, Volume):
            local = LocalVolume(vol.name, os.path.normpath(vol.mount_path), declared=True)
        else:
            local = LocalVolume(vol, f"/{vol}", declared=False)
        path = local.mount_path
        if any(path == top or path.startswith(top + "/") for top in _NO_MOUNTS_UNDER):
            raise ConfigError(
                f"volume {local.name!r} mounts at {path}, under {path.split('/')[1]!r}, "
                "which the local backend cannot mount into; pass another mount_path"
            )
        if home == path or home.startswith(path.rstrip("/") + "/"):
            raise ConfigError(
                f"volume {local.name!r} mounts at {path}, which would hide ktlite's own "
                f"state in {home} from local pods; pass another mount_path (or set "
                "KTLITE_HOME elsewhere)"
            )
        out.append(local)
    return out


def prepare(volumes: list[LocalVolume], owner: str) -> None:
    """Make the volumes' directories that do not exist yet; a ``kt.Volume`` that makes its
    directory records ``owner`` as the deployment that deletes it."""
    private_home()
    root = volumes_root()
    privatefiles.make_dir(root)
    for vol in volumes:
        try:
            vol.source.mkdir(mode=privatefiles.DIR_MODE)
        except FileExistsError:
            continue
        marker = root / f"{vol.name}.owner"
        if vol.declared:
            privatefiles.write_file(marker, owner)
        else:  # an existing PVC's name: its directory belongs to no deployment
            marker.unlink(missing_ok=True)


def delete_owned(owner: str) -> list[str]:
    """Delete the volume directories deployment ``owner`` made; returns their names."""
    root = volumes_root()
    deleted = []
    for marker in sorted(root.glob("*.owner")) if root.is_dir() else []:
        try:
            mine = marker.read_text().strip() == owner
        except OSError:
            continue
        if mine:
            shutil.rmtree(root / marker.stem, ignore_errors=True)
            marker.unlink(missing_ok=True)
            deleted.append(marker.stem)
    return deleted


def mounts_available() -> tuple[bool, str]:
    """Whether local pods can get their volumes at their mount paths, and if not, why."""
    global _probed
    if os.environ.get("KTLITE_LOCAL_MOUNTS", "").strip().lower() in ("0", "false", "no", "off"):
        return False, "KTLITE_LOCAL_MOUNTS=0 turns volume mounts off"
    if not sys.platform.startswith("linux"):
        return False, f"mounting needs Linux's private mount namespaces, and this is {sys.platform}"
    if _probed is None:
        _probed = _probe()
    return _probed


def _probe() -> tuple[bool, str]:
    """Start a throwaway process the way a pod starts, with a volume at a path the host
    lacks; it must see the volume's file there, and the host must not see the path after."""
    home = private_home()
    scratch = Path(privatefiles.scratch_dir("mount-probe-", home))
    target = f"/ktlite-probe-{uuid.uuid4().hex[:12]}"
    try:
        (scratch / "root").mkdir()
        (scratch / "vol").mkdir()
        (scratch / "vol" / "seen").write_text("")
        check = f"import os, sys; sys.exit(0 if os.path.isfile({target + '/seen'!r}) else 3)"
        cmd = wrap([sys.executable, "-c", check], [(scratch / "vol", target)], scratch / "root")
        try:
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                cwd=scratch,
            )  # as a pod starts: not in the caller's directory
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"the mount namespace probe failed: {e}"
        if os.path.lexists(target):  # mounts leaked to the host: never use them
            return False, f"the mount namespace probe changed the host ({target} appeared)"
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            return False, f"this machine gives ktlite no private mount namespace ({why})"
        return True, ""
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def wrap(command: list[str], binds: list[tuple[Path, str]], root: Path) -> list[str]:
    """``command`` started through ``ktlite_server.mountns`` with ``binds`` (directory,
    mount path) in place; ``root`` is an empty directory the new root is built on."""
    args = [sys.executable, "-m", "ktlite_server.mountns", "--root", str(root)]
    for source, path in binds:
        args += ["--bind", str(source), path]
    return [*args, "--", *command]
