"""Shared test setup: every xdist worker gets its own KTLITE_HOME so deployment names
never collide, and every deployment a test creates is torn down at the end."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile

import pytest
from loadscale import time_scale

_HOME = tempfile.mkdtemp(prefix=f"ktlite-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
os.environ["KTLITE_HOME"] = _HOME
os.environ.pop("KTLITE_BACKEND", None)


# The modules that take longest go first, longest first, the rest as collected. pyproject's
# `--dist loadfile --no-loadscope-reorder` keeps each module on one xdist worker, so its module
# fixtures (warm deployments) are made once, and hands a worker the next module when it is
# done, in this order: the long ones run beside the rest and the run ends on short ones (a long
# module left out of the list ends the run late: test_submitted_calls.py, 113th of 121). Measured:
# the sum of each module's test durations (`pytest -n 2 --durations=0`), averaged over two
# runs at load 5-17 (their shares of the total); modules under ~10 s are left as collected.
# The stand-in cluster run is four modules in the default run (tests/kube_e2e.py), so its
# parts spread over the workers.
_FIRST = (
    "tests/test_local_calls.py",
    "tests/test_kube_store.py",
    "tests/test_app.py",
    "tests/faults/test_rank_error.py",
    "tests/test_kube_e2e_calls.py",
    "tests/test_kube_e2e_faults.py",
    "tests/test_kube_ttl_e2e.py",
    "tests/test_kube_e2e_lifecycle.py",
    "tests/test_kube_e2e_groups.py",
    "tests/faults/test_timeouts.py",
    "tests/test_kube_bootstrap.py",
    "tests/test_kube_backend.py",
    "tests/test_pg_recovery.py",
    "tests/test_cli.py",
    "tests/faults/test_soak.py",
    "tests/test_serving.py",
    "tests/test_rank_preload.py",
    "tests/test_bench_scale.py",
    "tests/faults/test_tree.py",
    "tests/test_errors_logs.py",
    "tests/test_server_limits.py",
    "tests/test_kube_manifests.py",
    "tests/faults/test_pod_death.py",
    "tests/test_submitted_calls.py",
    "tests/test_dashboard.py",
    "tests/test_kube_serving.py",
    "tests/test_local_volumes.py",
    "tests/test_partial_restart.py",
    "tests/test_deploy_cli.py",
    "tests/test_store_safety.py",
    "tests/test_kubeconfig.py",
    "tests/test_futures.py",
    "tests/test_result_stream.py",
    "tests/faults/test_restarts.py",
    "tests/test_store_cli.py",
    "tests/test_groups_nemo.py",
    "tests/test_config_cli.py",
    "tests/faults/test_hostile_input.py",
    "tests/test_boot.py",
    "tests/test_kube_watch.py",
    "tests/test_forward_pieces.py",
    "tests/faults/test_rank_death.py",
    "tests/test_pod_table.py",
    "tests/test_launch_generations.py",
    "tests/test_colocation.py",
    "tests/test_kubetorch_api.py",
    "tests/test_concurrency.py",
    "tests/test_served_app.py",
    "tests/test_kube_tls.py",
    "tests/test_server_auth.py",
    "tests/test_store.py",
    "tests/test_bulk_data.py",
)


def _parse_schemas_once() -> None:
    """kubernetes-validate (the official schemas the manifest tests check against) parses its
    JSON schema files, the definitions file among them (megabytes), again for every object it
    validates: about 8 ms an object where a parsed one takes 1, and the suite validates
    thousands. The parsed files are kept (they are only read); the validation is unchanged."""
    try:
        import kubernetes_validate.utils as schemas
    except ImportError:  # the dev extra's; the tests that use it skip without it
        return
    schemas.schema_contents = functools.cache(schemas.schema_contents)


_parse_schemas_once()


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return _FIRST.index(path) if path in _FIRST else len(_FIRST)


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's pytest-timeout limit (its marker's, else the configured one) times the load
    scale: on a busy machine a test may take longer without being taken for a hang."""
    scale = time_scale()
    if scale <= 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = (
            marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
            if marker
            else default
        )
        if limit:
            item.add_marker(pytest.mark.timeout(float(limit) * scale), append=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: else as collected
    _scale_timeouts(config, items)
    if os.environ.get("KTLITE_TEST_KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="set KTLITE_TEST_KUBECONFIG to run against a real cluster")
    for item in items:
        if "kubernetes" in item.keywords:
            item.add_marker(skip)


# modules that cost every process collecting the suite (each xdist worker, and .ci/test's
# collection first) seconds of CPU when a test module imports them at its top; the tests that
# need one import it where they use it (tests/test_suite.py checks the collection imported none)
HEAVY_MODULES = ("torch",)
_HEAVY_AT_COLLECTION = pytest.StashKey[list[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_HEAVY_AT_COLLECTION] = [m for m in HEAVY_MODULES if m in sys.modules]


@pytest.fixture
def heavy_modules_imported_by_collection(pytestconfig: pytest.Config) -> list[str]:
    """Which of :data:`HEAVY_MODULES` were imported once this process had collected its tests."""
    return pytestconfig.stash[_HEAVY_AT_COLLECTION]


@pytest.fixture(scope="session")
def torch():
    """The torch module, for the tests that take it: they alone skip where the torch extra is
    not installed (a module-level importorskip would skip its neighbours too)."""
    return pytest.importorskip("torch")


@pytest.fixture(scope="session", autouse=True)
def _teardown_everything():
    yield
    from ktlite.backends.local import LocalBackend

    backend = LocalBackend.shared()
    for row in backend.list():
        backend.teardown(row["name"], timeout=5)
    shutil.rmtree(_HOME, ignore_errors=True)
