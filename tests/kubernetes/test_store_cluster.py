"""The data store (``kt.put/get/ls/rm``) against a real cluster (opt-in; see ``conftest.py``).

The store is the namespace's ``ktlite-store`` pod with its PVC, made by the first ``kt.put``
(it needs a StorageClass: the ``storage_class`` fixture's rules, KTLITE_TEST_SKIP_VOLUMES
skips this test). A store that was already there (someone else's data) is used and left in
place; one this test made is torn down with its volume at the end. Keys live under a prefix
of this run only.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt

pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
STORE_POD = "ktlite-store-0"


def store_user(prefix: str) -> dict[str, Any]:
    """A rank: reads what the caller stored, writes its own key."""
    import hashlib
    import os

    import ktlite as kt
    from ktlite.errors import DataStoreError

    rank = int(os.environ["RANK"])
    try:
        tree = kt.get(f"{prefix}/tree", f"/tmp/{prefix}-tree-{rank}")
        big = kt.get(f"{prefix}/big.bin", f"/tmp/{prefix}-big-{rank}")
        kt.put(
            f"{prefix}/from-rank-{rank}", {"rank": rank, "pod": os.environ.get("KTLITE_POD_NAME")}
        )
        return {
            "rank": rank,
            "config": kt.get(f"{prefix}/config"),
            "files": sorted(p.name for p in tree.iterdir()),
            "big": hashlib.sha256(big.read_bytes()).hexdigest(),
        }
    except DataStoreError as e:
        return {"rank": rank, "error": str(e)}


@pytest.mark.kubernetes
@pytest.mark.kubernetes_volumes
@pytest.mark.timeout(900)
def test_store_from_the_caller_and_from_pods(
    settings,
    deployments,
    make_compute,
    kube,
    storage_class,
    run_prefix,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("KTLITE_IMAGE", settings.image)
    monkeypatch.setenv("KTLITE_IMAGE_PULL_POLICY", settings.pull_policy)
    monkeypatch.setenv("KTLITE_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KTLITE_STORE_TIMEOUT", "600")
    if storage_class:
        monkeypatch.setenv("KTLITE_STORE_STORAGE_CLASS", storage_class)
    if settings.volume_user is not None:
        monkeypatch.setenv("KTLITE_STORE_RUN_AS_USER", str(settings.volume_user))
    where = {"backend": "kubernetes", "namespace": settings.namespace}
    had_store = any(
        s.metadata.name == "ktlite-store" for s in kube.list("statefulsets", "ktlite.dev/store")
    )
    prefix = f"{run_prefix}-store"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha")
    (tree / "sub" / "b.bin").write_bytes(os.urandom(200_000))
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(20):
            f.write(os.urandom(1 << 20))
    want = hashlib.sha256(big.read_bytes()).hexdigest()
    try:
        kt.put(f"{prefix}/config", {"lr": 0.25}, **where)  # creates the store if needed
        started = time.monotonic()
        kt.put(f"{prefix}/big.bin", big, **where)
        up = time.monotonic() - started
        kt.put(f"{prefix}/tree", tree, **where)
        started = time.monotonic()
        out = kt.get(f"{prefix}/big.bin", tmp_path / "big.out", **where)
        down = time.monotonic() - started
        print(
            f"\n20 MB through the API server's pod proxy: put {20 / up:.1f} MB/s, get {20 / down:.1f} MB/s"
        )
        assert hashlib.sha256(out.read_bytes()).hexdigest() == want
        assert {e["name"] for e in kt.ls(prefix, **where)} == {"config", "big.bin", "tree/"}

        # the store is no deployment: it has no ktlite.dev/name label, its pod has a PVC
        pod = kube.pod(STORE_POD)
        assert "ktlite.dev/name" not in (pod.metadata.labels or {})
        assert any(v.persistent_volume_claim for v in pod.spec.volumes)

        # ranks reach it by pod IP with the address handed over at deploy time
        name = deployments.name("store")
        remote = deployments.to(store_user, make_compute(workers=2), name)
        results = remote(prefix)
        assert [r.get("error") for r in results] == [None, None], results
        assert all(
            r["config"] == {"lr": 0.25} and r["files"] == ["a.txt", "sub"] and r["big"] == want
            for r in results
        )
        assert kt.get(f"{prefix}/from-rank-1", **where)["pod"] == f"{name}-1"

        # the store pod is replaced: new IP, same data; pods learn it at the next .to()
        old_ip = pod.status.pod_ip
        kube.delete("pods", STORE_POD)
        deadline = time.monotonic() + 600
        while True:
            try:
                new = kube.pod(STORE_POD)
            except Exception:  # noqa: BLE001 - not re-created yet
                new = None
            if (
                new is not None
                and not new.metadata.deletion_timestamp
                and new.status.pod_ip
                and new.status.pod_ip != old_ip
            ):
                break
            assert time.monotonic() < deadline, "the store pod was not re-created within 600 s"
            time.sleep(2)
        assert kt.get(f"{prefix}/config", **where) == {"lr": 0.25}  # waits until it answers
        stale = remote(prefix)
        assert all(
            old_ip in r.get("error", "") and "call .to() again" in r["error"] for r in stale
        ), stale
        remote = deployments.to(store_user, make_compute(workers=2), name)
        assert [r.get("error") for r in remote(prefix)] == [None, None]

        # a deployment's teardown leaves the store and its keys
        remote.teardown()
        assert {e["name"] for e in kt.ls(prefix, **where)} >= {
            "config",
            "from-rank-0",
            "from-rank-1",
        }
        with pytest.raises(kt.DataStoreError, match="no key"):
            kt.get(f"{prefix}/nope", **where)
    finally:
        try:
            kt.rm(prefix, recursive=True, **where)
        finally:
            if not had_store:
                from ktlite.backends.kube_store import KubeStore
                from ktlite.backends.kubernetes import KubernetesBackend

                KubeStore(KubernetesBackend.shared(settings.namespace)).teardown(volumes=True)


@pytest.mark.kubernetes
@pytest.mark.kubernetes_volumes
@pytest.mark.timeout(900)
def test_a_store_that_cannot_start_is_rolled_back(
    settings, kube, storage_class, run_prefix, monkeypatch: pytest.MonkeyPatch
):
    """A store whose pods are told to install a ktlite (``KTLITE_INSTALL``) on a cluster whose
    pods cannot reach an index: the store pod's setup exits 78 and the pod crash-loops. The attempt removes what it made (nothing of
    it is left but a claim that goes with its pod), and the next attempt, with the source the client
    ships, makes a new store instead of failing against the old one."""
    if any(
        s.metadata.name == "ktlite-store" for s in kube.list("statefulsets", "ktlite.dev/store")
    ):
        pytest.skip("the namespace has a data store already (someone's data): not replaced here")
    # an install the pods cannot do (they have no network): the setup exits 78
    monkeypatch.setenv("KTLITE_INSTALL", "ktlite-does-not-exist==0.1")
    monkeypatch.setenv("KTLITE_IMAGE_PULL_POLICY", settings.pull_policy)
    monkeypatch.setenv("KTLITE_NAMESPACE", settings.namespace)
    monkeypatch.setenv("KTLITE_STORE_TIMEOUT", "600")
    if storage_class:
        monkeypatch.setenv("KTLITE_STORE_STORAGE_CLASS", storage_class)
    if settings.volume_user is not None:
        monkeypatch.setenv("KTLITE_STORE_RUN_AS_USER", str(settings.volume_user))
    where = {"backend": "kubernetes", "namespace": settings.namespace}
    from ktlite.backends.kube_store import KubeStore
    from ktlite.backends.kubernetes import KubernetesBackend

    try:
        with pytest.raises(kt.DataStoreError) as err:
            kt.put(f"{run_prefix}-rollback/k", {"v": 1}, **where)
        text = str(err.value)
        print(f"\n{text}")
        assert "the pod's setup failed" in text and "ktlite store create --image IMAGE" in text
        assert (
            "removed what this attempt created (Secret ktlite-store-token, PersistentVolumeClaim "
            "ktlite-store, StatefulSet ktlite-store)" in text
        )
        assert [s.metadata.name for s in kube.list("statefulsets", "ktlite.dev/store")] == []
        assert [s.metadata.name for s in kube.list("secrets", "ktlite.dev/store")] == []
        monkeypatch.delenv("KTLITE_INSTALL")  # the source the client ships, as by default
        monkeypatch.setenv("KTLITE_IMAGE", settings.image)
        started = time.monotonic()
        kt.put(f"{run_prefix}-rollback/k", {"v": 1}, **where)  # a new store
        print(f"the next attempt made a store in {time.monotonic() - started:.1f} s")
        assert kt.get(f"{run_prefix}-rollback/k", **where) == {"v": 1}
    finally:
        KubeStore(KubernetesBackend.shared(settings.namespace)).teardown(volumes=True)
