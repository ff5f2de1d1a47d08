"""Shared test setup: every xdist worker gets its own KTLITE_HOME so deployment names
never collide, and every deployment a test creates is torn down at the end."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_HOME = tempfile.mkdtemp(prefix=f"ktlite-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
os.environ["KTLITE_HOME"] = _HOME
os.environ.pop("KTLITE_BACKEND", None)


# the longest tests go first, so that under xdist they run beside the rest, not after it
_FIRST = ("tests/test_kube_e2e.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.nodeid.startswith(_FIRST) else 1)  # stable: else as collected
    if os.environ.get("KTLITE_TEST_KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="set KTLITE_TEST_KUBECONFIG to run against a real cluster")
    for item in items:
        if "kubernetes" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _teardown_everything():
    yield
    from ktlite.backends.local import LocalBackend

    backend = LocalBackend.shared()
    for row in backend.list():
        backend.teardown(row["name"], timeout=5)
    shutil.rmtree(_HOME, ignore_errors=True)
