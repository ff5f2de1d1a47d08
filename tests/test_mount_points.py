"""The stand-in clusters' shared mount points (``tests/mount_points.py``): a directory one
cluster's pods mount is not removed while another cluster lives. Removing it unmounted it in
the other cluster's pods (Linux detaches a mount whose directory is removed in another
namespace): CI saw a pod of one stand-in start without its token file while another stand-in
stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mount_points import MountPoints


def test_the_last_live_cluster_removes_the_mount_points(tmp_path: Path) -> None:
    registry, root = tmp_path / "registry", tmp_path / "root"
    root.mkdir()
    first = MountPoints(registry)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        second = MountPoints(registry, pid=other.pid)  # another stand-in, alive
        first.make(root / "var/run/ktlite/token")
        second.make(root / "var/run/ktlite/token")
        second.make(root / "data")
        first.release()
        assert (root / "var/run/ktlite/token").is_dir() and (root / "data").is_dir()
        second.release()  # the last live one: everything registered goes, deepest first
        assert not (root / "var").exists() and not (root / "data").exists()
        assert root.is_dir()  # it existed before: not registered, not removed
    finally:
        other.kill()
        other.wait(10)


def test_a_cluster_that_died_without_releasing_does_not_keep_them(tmp_path: Path) -> None:
    registry, root = tmp_path / "registry", tmp_path / "root"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    gone = MountPoints(registry, pid=dead.pid)
    gone.make(root / "store")
    mine = MountPoints(registry)
    mine.release()
    assert not (root / "store").exists()
    assert not list(registry.glob("*.live"))


def test_a_directory_still_in_use_is_left(tmp_path: Path) -> None:
    registry, root = tmp_path / "registry", tmp_path / "root"
    mine = MountPoints(registry)
    mine.make(root / "home/ktlite")
    (root / "home/ktlite/file").write_text("not ours to remove")
    mine.release()
    assert (root / "home/ktlite/file").read_text() == "not ours to remove"
