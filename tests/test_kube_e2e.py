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
from xml.etree import ElementTree

import pytest

HERE = Path(__file__).parent
EXPECTED_SKIP = "KTLITE_TEST_SKIP_VOLUMES is set"  # the only skip expected (set below)


def _outcomes(junit: Path) -> list[tuple[str, str]]:
    """(test, "passed" / "failure" / "error" / "skipped: <reason>") for each test case of
    pytest's JUnit XML report; a list, as a test whose teardown fails may appear twice."""
    out = []
    for case in ElementTree.parse(junit).iter("testcase"):
        marks = {child.tag: child.get("message", "") for child in case}
        outcome = next((tag for tag in ("failure", "error") if tag in marks), None)
        if outcome is None:
            outcome = f"skipped: {marks['skipped']}" if "skipped" in marks else "passed"
        out.append((f"{case.get('classname')}::{case.get('name')}", outcome))
    return out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="the stand-in cluster's pods need root and unshare (own hostname)")
@pytest.mark.timeout(560)
def test_cluster_suite_against_the_stand_in_cluster(tmp_path: Path) -> None:
    # the pod proxy cuts streams as the API server's does (Go's race on Content-Length bodies),
    # and then some more: every call of the suite must survive them
    harness_env = {**os.environ, "KTLITE_HARNESS_CUT": "sized=0.1,post=0.02"}
    with open(tmp_path / "harness.log", "wb") as log:
        harness = subprocess.Popen([sys.executable, str(HERE / "kube_harness.py"), str(tmp_path)],
                                   stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                   env=harness_env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "kubeconfig").exists():
            assert harness.poll() is None, (tmp_path / "harness.log").read_text()
            assert time.monotonic() < deadline, "the stand-in cluster did not start within 30 s"
            time.sleep(0.05)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KTLITE_", "PYTEST_", "KUBECONFIG"))}
        env.update(KTLITE_TEST_KUBECONFIG=str(tmp_path / "kubeconfig"), KTLITE_TEST_SKIP_VOLUMES="1",
                   KTLITE_HOME=str(tmp_path / "home"), KTLITE_TEST_PROXY_CALLS="250",
                   KTLITE_TEST_PROXY_MB_CALLS="40",
                   KTLITE_TEST_GPUS="8")  # the stand-in schedules any resource a pod asks for
        junit = tmp_path / "suite.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-m", "kubernetes", f"--junitxml={junit}", str(HERE / "kubernetes")],
                             env=env, capture_output=True, text=True, timeout=500, cwd=HERE.parent)
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-60:])
        assert run.returncode == 0, tail
        # every collected test passed, but those skipped for the one reason expected here: a
        # test skipped for any other reason would otherwise pass unnoticed
        outcomes = _outcomes(junit)
        unexpected = [(test, outcome) for test, outcome in outcomes
                      if outcome not in ("passed", f"skipped: {EXPECTED_SKIP}")]
        assert outcomes and not unexpected, f"{unexpected}\n{tail}"
    finally:
        os.killpg(harness.pid, signal.SIGTERM)
        try:
            harness.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(harness.pid, signal.SIGKILL)
            harness.wait(5)
