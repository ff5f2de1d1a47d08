"""What an SSH host's launcher (``python -m ktlite_server.sshlaunch``) does when the host's
Python lacks the pod server's packages and the client could not ship its own (another minor
version or machine): it asks no package index, and says how to get them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _launch(tmp_path: Path, pins: dict[str, str], steps: list[object]) -> dict[str, object]:
    msg = {
        "token": "not-used",
        "env": {},
        "args": [],
        "run_dir": str(tmp_path / "run"),
        "cache_dir": str(tmp_path / "cache"),
        "steps": steps,
        "detached": True,
        "bind": "127.0.0.1",
        "pick_master_port": 0,
        "timeout": 60,
        "secret_files": [],
        "pins": pins,
    }
    done = subprocess.run(
        [sys.executable, "-m", "ktlite_server.sshlaunch"],
        input=json.dumps(msg) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_host_lacking_the_servers_packages_is_told_how_to_get_them_and_no_index_is_asked(
    tmp_path: Path,
) -> None:
    # cloudpickle at a version no Python has: "missing", as on a host with another minor
    reply = _launch(tmp_path, {"cloudpickle": "0.0.1"}, steps=[])
    error = str(reply["error"])
    assert "cloudpickle==0.0.1" in error and sys.executable in error, error
    assert "-m pip install cloudpickle==0.0.1" in error, error  # to run there
    assert "kt.Hosts(..., python=...)" in error, error
    assert "kt.Image().pip_install(['cloudpickle==0.0.1'])" in error, error  # the opt-in
    cache = tmp_path / "cache"
    assert not [p.name for p in cache.iterdir() if p.name.startswith("venv")], "a venv was made"
    log = (tmp_path / "run" / "pod.log").read_text()
    assert "pip" not in log, log


def test_packages_still_missing_after_the_images_setup_steps_name_the_steps(
    tmp_path: Path,
) -> None:
    """The check comes after the steps (a ``pip_install`` step may bring the packages). A host
    whose only steps were ``run_bash`` once crashed there: its setup directory was never made."""
    reply = _launch(tmp_path, {"cloudpickle": "0.0.1"}, steps=[["run_bash", "true"]])
    error = str(reply["error"])
    assert "the image's setup steps did not install them" in error, error
