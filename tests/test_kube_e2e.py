"""The opt-in real-cluster suite (``tests/kubernetes``), run here against the stand-in cluster
of ``kube_harness.py``: a fake API server over real HTTP, a kubeconfig with a token, and a
real ktlite server process behind every pod, reached through the pod proxy, with real gloo
between pods by IP. Only the control plane is fake; against a real cluster, run the suite
itself (README: "Kubernetes").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="the stand-in cluster's pods need root and unshare (own hostname)")
@pytest.mark.timeout(400)
def test_cluster_suite_against_the_stand_in_cluster(tmp_path: Path) -> None:
    with open(tmp_path / "harness.log", "wb") as log:
        harness = subprocess.Popen([sys.executable, str(HERE / "kube_harness.py"), str(tmp_path)],
                                   stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "kubeconfig").exists():
            assert harness.poll() is None, (tmp_path / "harness.log").read_text()
            assert time.monotonic() < deadline, "the stand-in cluster did not start within 30 s"
            time.sleep(0.05)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KTLITE_", "PYTEST_", "KUBECONFIG"))}
        env.update(KTLITE_TEST_KUBECONFIG=str(tmp_path / "kubeconfig"), KTLITE_TEST_SKIP_VOLUMES="1",
                   KTLITE_HOME=str(tmp_path / "home"))
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-m", "kubernetes", str(HERE / "kubernetes")],
                             env=env, capture_output=True, text=True, timeout=360, cwd=HERE.parent)
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-60:])
        assert run.returncode == 0, tail
        assert "9 passed" in run.stdout, tail
    finally:
        os.killpg(harness.pid, signal.SIGTERM)
        try:
            harness.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(harness.pid, signal.SIGKILL)
            harness.wait(5)
