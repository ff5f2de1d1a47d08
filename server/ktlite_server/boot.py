"""``python -m ktlite_server.boot``: a Kubernetes pod's entry point.

Runs the image's setup steps (``kt.Image.pip_install`` / ``run_bash``, JSON in the file
``KTLITE_SETUP_FILE`` names, from the deployment's Secret), checks that the server's packages
import, then execs the server, so the pod answers /health (and becomes ready) only once the
steps are done.

Caching, keyed by the steps' content hash: pip steps install into a venv on the pod's
emptyDir (``/ktlite/venv``) that sees the image's own packages, and a marker file records
that they succeeded, so a restarted container skips them. ``run_bash`` steps changed the
container's filesystem, which a restart throws away, so they run again in each new
container. A failing step prints its output and exits with code 78, which the client
reports as a failed deploy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from ktlite_server import logconfig
from ktlite_server.packages import SERVER_PACKAGES, missing_in
from ktlite_wire import privatefiles

logger = logging.getLogger("ktlite_server.boot")  # not __name__: this module also runs as __main__
SETUP_FAILED_EXIT = 78


def _say(text: str) -> None:
    print(f"ktlite setup: {text}", flush=True)


def _run(argv: list[str], what: str) -> None:
    _say(what)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        print(f"  {line}", flush=True)
    if proc.returncode != 0:
        logger.error("setup step failed with exit code %d: %s", proc.returncode, what)
        sys.exit(SETUP_FAILED_EXIT)


def _venv(state: Path) -> Path:
    """A venv on the emptyDir whose imports fall back to this interpreter's packages."""
    root = state / "venv"
    python = root / "bin" / "python"
    if Path(sys.prefix) == root:
        return python
    if not python.exists():
        _say(f"creating {root}")
        venv.EnvBuilder(with_pip=True, symlinks=True).create(root)
        out = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        parents = [
            p for p in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(p)
        ]
        parents += [p for p in sys.path if p.endswith("site-packages") and p not in parents]
        # addsitedir, not bare path lines: it also runs the .pth files found there
        # (editable installs, namespace packages)
        Path(out, "_ktlite_image_packages.pth").write_text(
            f"import site; list(map(site.addsitedir, {parents!r}))\n"
        )
    return python


def run_steps(steps: list[list[Any]], state: Path) -> str:
    """Run ``steps`` in order; returns the Python the server should run under."""
    digest = hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()[:16]
    marker = state / f"setup-{digest}.done"
    cached = marker.exists()
    python = sys.executable
    # Image(install_cmd=...): the image's own installer (e.g. uv) into the image's Python
    pip_cmd = os.environ.get("KTLITE_PIP_CMD")
    if any(kind == "pip_install" for kind, _ in steps) and not pip_cmd:
        python = str(_venv(state))
    shell = shutil.which("bash") or "/bin/sh"
    for i, (kind, arg) in enumerate(steps, 1):
        if kind == "pip_install":
            if cached:
                _say(f"step {i}: pip install {' '.join(arg)} (cached, {digest})")
                continue
            if pip_cmd:
                _run(
                    [shell, "-c", f"{pip_cmd} {shlex.join(arg)}"],
                    f"step {i}: {pip_cmd} {' '.join(arg)}",
                )
                continue
            _run(
                [python, "-m", "pip", "install", "--disable-pip-version-check", *arg],
                f"step {i}: pip install {' '.join(arg)}",
            )
        elif kind == "run_bash":
            _run([shell, "-c", arg], f"step {i}: {arg}")
        else:
            logger.error("unknown step %r; this server is older than the client", kind)
            sys.exit(SETUP_FAILED_EXIT)
    privatefiles.make_dir(state)  # run_bash steps alone made no venv in it
    privatefiles.write_file(marker, json.dumps(steps))
    return python


def _steps() -> list[list[Any]]:
    """The image's setup steps: the file the deployment's Secret mounts, else the env (a pod
    spec of an older client)."""
    path = os.environ.get("KTLITE_SETUP_FILE")
    steps: list[list[Any]]
    if path:
        with open(path, encoding="utf-8") as f:
            steps = json.load(f)
        return steps
    steps = json.loads(os.environ.get("KTLITE_SETUP") or "[]")
    return steps


def check_packages(python: str) -> None:
    """Exit 78 with what to do when ``python`` lacks a package the server needs (after what
    the client shipped: its own copies fit only a Python like its own); ktlite asks no
    package index for them."""
    missing = missing_in(python, {})
    if not missing:
        return
    image = os.environ.get("KTLITE_IMAGE") or "this image"
    listed = ", ".join(missing)
    logger.error(
        "the image %s lacks the pod server's packages %s (%s), and the client could not ship "
        "its own (only a Linux client does, to a Python of its version and machine); ktlite "
        "installs nothing from a package index unless asked: use an image that has them "
        "(ktlite's images/Dockerfile builds one; or pip install %s in yours), or add "
        "kt.Image(...).pip_install(%r) to install them from your index at pod start",
        image,
        listed,
        python,
        " ".join(SERVER_PACKAGES),
        list(SERVER_PACKAGES),
    )
    sys.exit(SETUP_FAILED_EXIT)


def main() -> None:
    logconfig.configure()
    steps = _steps()
    python = sys.executable
    if steps and os.environ.get("KTLITE_FREEZE") != "1":
        state = Path(os.environ.get("KTLITE_STATE_DIR", "/ktlite"))
        privatefiles.make_dir(state)
        python = run_steps(steps, state)
        _say("done")
    check_packages(python)
    argv = [
        python,
        "-m",
        "ktlite_server",
        "--host",
        os.environ.get("KTLITE_HOST", "0.0.0.0"),
        "--port",
        os.environ.get("KTLITE_PORT", "32300"),
        "--procs",
        os.environ.get("KTLITE_PROCS", "1"),
    ]
    sys.stdout.flush()
    os.execv(python, argv)


if __name__ == "__main__":
    main()
