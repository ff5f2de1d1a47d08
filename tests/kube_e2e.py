"""The opt-in real-cluster suite (``tests/kubernetes``), run against the stand-in cluster of
``kube_harness.py``: a fake API server over real HTTP, a kubeconfig with a token, and a real
ktlite server process behind every pod, reached through the pod proxy, with real gloo between
pods by IP. Only the control plane is fake; against a real cluster, run the suite itself
(README: "Kubernetes").

The suite runs in parts (``PARTS``), one pytest process per part, each part in a test module
of its own (``tests/test_kube_e2e_<part>.py``, ``PART_FILES``): pytest-xdist keeps a module
on one worker (``--dist loadfile``), so the parts spread over the workers. Each of those
modules starts its own stand-in cluster (``stand_in_fixture``). ``tests/test_kube_e2e.py``
checks that the parts cover the suite once and that each part has its module.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from loadscale import time_scale

HERE = Path(__file__).parent
SUITE = HERE / "kubernetes"
EXPECTED_SKIP = "KTLITE_TEST_SKIP_VOLUMES is set"  # the only skip expected (set below)
# the parts: each a list of files or tests of the suite (every test of the suite is in exactly
# one part: test_the_parts_cover_the_suite_once), of about equal time (180-200 s each on a
# 2-core machine at load 18, 40-50 s of it alone), the longest first, but for 'ray-monarch'
# (outside the default run); each runs in the test module PART_FILES names
CLUSTER = "test_cluster.py::test_"
RESILIENCE = "test_resilience.py::test_"
PARTS: dict[str, tuple[str, ...]] = {
    "calls-kubetorch-secrets": (
        *(
            CLUSTER + t
            for t in (
                "single_call_returns_value_from_pod_0",
                "pods_run_as_non_root_and_user_code_cannot_read_the_token_from_any_environment",
                "an_image_with_only_python_gets_ktlite_and_its_packages_from_the_client",
                "gloo_all_reduce_across_two_pods",
                "uneven_pods_1_and_2_ranks_all_reduce",
                "rank_error_keeps_its_type_and_the_finished_results",
                "logs_hold_each_ranks_lines_and_calls_stream_them",
                "the_dashboard_shows_a_cluster_deployment",
                "app_runs_a_command_in_the_shipped_working_directory",
            )
        ),
        "test_kubetorch_cluster.py",
        "test_secrets_cluster.py",
    ),
    "faults-serving": (
        *(
            RESILIENCE + t
            for t in (
                "a_pod_deleted_mid_call_fails_that_call_and_the_next_call_works",
                "a_pod_deleted_while_idle_is_found_by_the_next_call",
                "a_volume_that_cannot_bind_fails_the_deploy_and_nothing_is_left",
                "a_failed_first_deploy_removes_what_it_created",
                "a_failing_setup_step_fails_the_deploy_with_its_own_log",
            )
        ),
        "test_serving_cluster.py",
    ),
    # real Ray and Monarch: long real-engine tests, run with the `ray` and `monarch` tests
    # (.ci/test's second half), not in the default run (test_kube_e2e_engines.py's markers)
    "ray-monarch": (
        "test_ray_cluster.py",
        "test_monarch_cluster.py",
    ),
    "store-groups": (
        "test_store_cluster.py",
        "test_worker_groups.py",
    ),
    "proxied-lifecycle": (
        RESILIENCE + "proxied_calls_never_fail_and_never_run_twice",
        *(
            CLUSTER + t
            for t in (
                "redeploy_after_a_code_change_keeps_the_pods",
                "redeploy_with_a_changed_pod_field_replaces_the_pod",
                "teardown_leaves_nothing",
                "missing_image_fails_fast_with_the_pull_error",
                "unschedulable_request_fails_fast",
                "volume_outlives_the_pod_and_teardown_volumes_deletes_it",
                "a_served_app_is_reached_through_the_api_servers_pod_proxy",
            )
        ),
        "test_ttl_cluster.py",
    ),
}
PART_FILES = {
    "calls-kubetorch-secrets": "test_kube_e2e_calls.py",
    "faults-serving": "test_kube_e2e_faults.py",
    "ray-monarch": "test_kube_e2e_engines.py",
    "store-groups": "test_kube_e2e_groups.py",
    "proxied-lifecycle": "test_kube_e2e_lifecycle.py",
}
# one part, in its own pytest process: the longest takes about a quarter of it alone on a quiet
# 2-core machine; on a loaded one it gets more (loadscale; tests/conftest.py scales the
# pytest-timeout marker below alike)
PART_S = 300
PART_TIMEOUT_S = round(PART_S * time_scale())
START_TIMEOUT_S = 60  # the stand-in cluster writing its kubeconfig

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="the stand-in cluster's pods need root and unshare (own hostname)",
)


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


def _suite_env(root: Path, home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KTLITE_", "PYTEST_", "KUBECONFIG"))
    }
    env.update(
        KTLITE_TEST_KUBECONFIG=str(root / "kubeconfig"),
        KTLITE_TEST_SKIP_VOLUMES="1",
        KTLITE_HOME=str(home),
        KTLITE_TEST_PROXY_CALLS="250",
        KTLITE_TEST_PROXY_MB_CALLS="40",
        KTLITE_TEST_GPUS="8",
    )  # the stand-in schedules any resource a pod asks for
    return env


def _pytest(
    args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "kubernetes", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE.parent,
    )


def _stand_in(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """One stand-in cluster for a part's module: its directory (with the kubeconfig)."""
    root = tmp_path_factory.mktemp("stand-in")
    # the pod proxy cuts streams as the API server's does (Go's race on Content-Length bodies),
    # and then some more: every call of the suite must survive them
    harness_env = {**os.environ, "KTLITE_HARNESS_CUT": "sized=0.1,post=0.02"}
    with open(root / "harness.log", "wb") as log:
        harness = subprocess.Popen(
            [sys.executable, str(HERE / "kube_harness.py"), str(root)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env=harness_env,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (root / "kubeconfig").exists():
            assert harness.poll() is None, (
                f"the stand-in cluster exited: {(root / 'harness.log').read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"the stand-in cluster wrote no kubeconfig within {START_TIMEOUT_S} s; its log: "
                f"{(root / 'harness.log').read_text()[-3000:]}"
            )
            time.sleep(0.05)  # polling for the file, bounded by the deadline above
        yield root, harness
    finally:
        os.killpg(harness.pid, signal.SIGTERM)
        try:
            harness.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(harness.pid, signal.SIGKILL)
            harness.wait(5)


def stand_in_fixture() -> Any:
    """The module fixture ``stand_in`` (a stand-in cluster) for the part module that assigns it."""
    return pytest.fixture(scope="module", name="stand_in")(_stand_in)


def run_part(part: str, stand_in: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """Run the tests of ``part`` against the stand-in cluster in their own pytest process; fail
    unless every one passed (or skipped for the expected reason)."""
    root, harness = stand_in
    assert harness.poll() is None, (
        f"the stand-in cluster is gone: {(root / 'harness.log').read_text()[-3000:]}"
    )
    junit = tmp_path / "suite.xml"
    args = ["-q", f"--junitxml={junit}", *(str(SUITE / test) for test in PARTS[part])]
    try:
        run = _pytest(args, _suite_env(root, tmp_path / "home"), PART_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
        pytest.fail(
            f"part {part!r} ({' '.join(args[2:])}) did not end within {PART_TIMEOUT_S} s (load "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); its last output:\n{out[-4000:]}"
        )
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-60:])
    assert run.returncode == 0, tail
    # every collected test passed, but those skipped for the one reason expected here: a
    # test skipped for any other reason would otherwise pass unnoticed
    outcomes = _outcomes(junit)
    unexpected = [
        (test, outcome)
        for test, outcome in outcomes
        if outcome not in ("passed", f"skipped: {EXPECTED_SKIP}")
    ]
    assert outcomes and not unexpected, f"{unexpected}\n{tail}"


def _in(nodeid: str, selector: str) -> bool:
    """Whether ``selector`` (a file of the suite, or a test of one) selects the test ``nodeid``."""
    test = nodeid.split("kubernetes/", 1)[-1]
    return test == selector or test.startswith((f"{selector}::", f"{selector}["))


def check_parts_cover_the_suite_once(tmp_path: Path) -> None:
    """Every test of ``tests/kubernetes`` is in exactly one part, and every selector of a part
    selects a test (a new test, or a renamed one, fails here until it is put in a part)."""
    # collection only: no cluster is reached (the kubeconfig named is never read)
    run = _pytest(
        ["-q", "--collect-only", str(SUITE)], _suite_env(tmp_path, tmp_path / "home"), timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    tests = [line for line in run.stdout.splitlines() if "::" in line]
    assert tests, f"no test collected in tests/kubernetes: {run.stdout}"
    selectors = [s for part in PARTS.values() for s in part]
    problems = [
        f"{t} is in {n} parts" for t in tests if (n := sum(_in(t, s) for s in selectors)) != 1
    ]
    problems += [f"{s} selects no test" for s in selectors if not any(_in(t, s) for t in tests)]
    assert not problems, "\n".join(problems)
