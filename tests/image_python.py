"""A stand-in for a pod image's Python, for tests: a venv of this machine's base interpreter
that has no ktlite (as the real cluster's base image has none), with or without the packages
the pod server needs, so that a pod runs the source the client ships (``kube_boot``)."""

from __future__ import annotations

import contextlib
import site
import venv
from pathlib import Path


def make(root: Path, *, seen_at: str | None = None, server_packages: bool = True) -> Path:
    """The venv at ``root``. With ``server_packages``, its site-packages links to every package
    of this test run's except ktlite's own; ``seen_at``: the path the venv is bind-mounted at
    where it runs (a stand-in pod), which the links are written for."""
    venv.EnvBuilder(symlinks=True, with_pip=False).create(root)
    if not server_packages:
        return root
    packages = root / "packages"
    packages.mkdir()
    for parent in site.getsitepackages():
        for entry in Path(parent).iterdir():
            if "ktlite" in entry.name.lower() or entry.name == "__pycache__":
                continue
            with contextlib.suppress(FileExistsError):
                (packages / entry.name).symlink_to(entry)
    purelib = next((root / "lib").glob("python*/site-packages"))
    where = f"{seen_at or root}/packages"
    (purelib / "_image_packages.pth").write_text(f"import site; site.addsitedir({where!r})\n")
    return root
