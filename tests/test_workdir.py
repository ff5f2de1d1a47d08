"""Where local pods start and where user code runs: a caller whose working directory holds
folders named ``ktlite`` and ``ktlite_server`` (a checkout, a vendored copy) still deploys and
calls, its ranks run in that directory (relative paths work), and a detached autoscaled
deployment's own autoscaler process starts too. Pod servers once started in the caller's
directory, where ``python -m ktlite_server`` imported the caller's folders: ``/health``
answered 500 with an empty pod log and ``.to()`` failed with "HTTP 500"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ktlite.backends.local import LocalBackend

SCRIPT = """
import json, os, sys
import ktlite as kt

def where():
    import os
    import ktlite, ktlite_server
    with open("data.txt") as f:  # relative to the caller's working directory
        data = f.read()
    return {"cwd": os.getcwd(), "data": data, "ktlite": ktlite.__file__,
            "ktlite_server": ktlite_server.__file__}

def square(x):
    return x * x

name = sys.argv[1]
remote = kt.fn(where, name=name + "-fn").to(kt.Compute(cpus="0.1"))
print("WHERE " + json.dumps(remote()))
remote.teardown()
served = kt.fn(square, name=name + "-served").to(
    kt.Compute(cpus="0.1").autoscale(min_scale=0, max_scale=1, window="1s", scale_down_delay="0.5s",
                                      scale_to_zero_pod_retention_period="1s"), detached=True)
print("SQUARE", served(3))
"""


def _shadowing(root: Path) -> None:
    for package in ("ktlite", "ktlite_server"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(
            f"raise ImportError('the caller\\'s own {package} folder was imported')\n"
        )


@pytest.mark.timeout(180)
def test_a_ktlite_folder_in_the_callers_directory_shadows_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, scripts, home = tmp_path / "work", tmp_path / "scripts", tmp_path / "home"
    work.mkdir()
    scripts.mkdir()
    _shadowing(work)
    (work / "data.txt").write_text("read from the working directory")
    (scripts / "deploy_it.py").write_text(
        SCRIPT
    )  # beside no ktlite folder: the caller imports ktlite
    name = f"shadow-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "KTLITE_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, str(scripts / "deploy_it.py"), name],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    seen = json.loads(next(ln for ln in lines if ln.startswith("WHERE "))[6:])
    assert seen["cwd"] == str(work) and seen["data"] == "read from the working directory", seen
    assert not seen["ktlite"].startswith(str(work)) and not seen["ktlite_server"].startswith(
        str(work)
    ), seen
    assert "SQUARE 9" in lines, done.stdout
    # the detached deployment's autoscaler process started as well: alone now, it scales to zero
    monkeypatch.setenv("KTLITE_HOME", str(home))
    backend = LocalBackend.shared()
    served = f"{name}-served"
    try:
        deadline = time.monotonic() + 60
        while True:
            rows = [r for r in backend.list() if r["name"] == served]
            if rows and rows[0]["pods"] == 0:
                break
            log = home / "local" / served / "autoscaler.log"
            assert time.monotonic() < deadline, (
                rows,
                log.read_text() if log.exists() else "no log",
            )
            time.sleep(0.2)
    finally:
        backend.teardown(served, timeout=10)
