"""``inactivity_ttl`` on the stand-in cluster (``kube_harness.py``: real pod servers, the
fake API server with RBAC for the pods' ServiceAccount tokens): a deployment idle for longer
than its TTL is torn down, all its objects, by its own pod 0 where pods reach the API server,
and by the next ``ktlite list`` / ``ktlite teardown --expired`` where they cannot (as on a
cluster without kube-proxy); a deployment in use is not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import server_procs
from loadscale import time_scale

import ktlite as kt
from ktlite.backends import kube_manifests as km
from ktlite.backends.kube_api import KubeApi, load
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.commands import cli

HERE = Path(__file__).parent
KINDS = (
    "StatefulSet",
    "Service",
    "Secret",
    "NetworkPolicy",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Pod",
)
WAIT_S = 90 * time_scale()

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="the stand-in cluster's pods need root and unshare",
)


@contextlib.contextmanager
def _stand_in(root: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[KubeApi]:
    with open(root / "harness.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kube_harness.py"), str(root)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, **env},
        )
    try:
        deadline = time.monotonic() + 30 * time_scale()
        while not (root / "kubeconfig").exists():
            assert proc.poll() is None, (root / "harness.log").read_text()
            assert time.monotonic() < deadline, "the stand-in cluster did not start"
            time.sleep(0.05)  # polling for the file, bounded by the deadline
        monkeypatch.setenv("KTLITE_KUBECONFIG", str(root / "kubeconfig"))
        monkeypatch.setenv("KTLITE_BACKEND", "kubernetes")
        monkeypatch.setattr(KubernetesBackend, "_clients", {})
        http, info = load(str(root / "kubeconfig"))
        with http:
            yield KubeApi(http, info.namespace)
    finally:
        for client, _ in KubernetesBackend._clients.values():
            client.close()
        server_procs.stop_group(proc)


def _left(api: KubeApi, name: str) -> dict[str, list[str]]:
    """What is left of deployment ``name``, by kind."""
    found = {
        kind: [o["metadata"]["name"] for o in api.list(kind, km.selector(name))] for kind in KINDS
    }
    return {kind: names for kind, names in found.items() if names}


def _wait(read: Callable[[], Any], done: Callable[[Any], bool], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    value = read()
    while not done(value):
        assert time.monotonic() < deadline, f"{what} not within {WAIT_S:.0f} s; last: {value}"
        time.sleep(0.3)  # polling the cluster, bounded by the deadline
        value = read()
    return value


def _work(seconds: float) -> int:
    import os
    import time

    time.sleep(seconds)  # the call's own work: it runs for longer than the TTL
    return int(os.environ["RANK"])


def _compute(ttl: Any) -> kt.Compute:
    return kt.Compute(cpus=0.1, launch_timeout=120, inactivity_ttl=ttl).distribute(
        "spmd", workers=2
    )


@pytest.mark.timeout(300)
def test_an_idle_deployment_deletes_itself_and_not_while_a_call_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"ttl-{uuid.uuid4().hex[:6]}"
    with _stand_in(tmp_path, monkeypatch) as api:
        remote = kt.fn(_work, name=name).to(_compute(3))
        try:
            # in use for twice its TTL: had pod 0 counted that as idle, the call would fail
            assert remote(6.0) == [0, 1]
            assert set(_left(api, name)) == set(KINDS)
            _wait(lambda: _left(api, name), lambda left: not left, f"{name} gone")
            logs = api.pod_log(f"{name}-0")  # the pod is gone; its log, if kept, says why
            assert "Traceback" not in logs, logs
        finally:
            with contextlib.suppress(Exception):
                remote.teardown()


@pytest.mark.timeout(300)
def test_where_pods_cannot_reach_the_api_the_next_client_sweeps_what_expired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tag = uuid.uuid4().hex[:6]
    idle, kept = f"ttl-idle-{tag}", f"ttl-kept-{tag}"
    with _stand_in(tmp_path, monkeypatch, KTLITE_HARNESS_POD_API="unreachable") as api:
        first = kt.fn(_work, name=idle).to(_compute(2))
        second = kt.fn(_work, name=kept).to(_compute("1h"))
        try:
            assert first(0) == [0, 1] and second(0) == [0, 1]
            backend = KubernetesBackend.shared()

            def row() -> dict[str, Any]:
                return next(r for r in backend.list() if r["name"] == idle)

            _wait(row, lambda r: (r["idle_s"] or 0) > r["ttl_s"], f"{idle} expired")
            # its pod 0 tried, said why in its log, and serves on (list read its idle time)
            _wait(
                lambda: api.pod_log(f"{idle}-0"),
                lambda log: "could not be reached" in log,
                "pod 0's notice",
            )
            assert row()["ready"] == 2  # it did not exit into a restart loop: it serves on
            capsys.readouterr()
            assert cli.main(["teardown", "--expired", "--dry-run"]) == 0
            out = capsys.readouterr().out
            assert f"{idle}: would be torn down (idle " in out and kept not in out, out
            assert "StatefulSet" in _left(api, idle)
            assert cli.main(["list"]) == 0
            listed = capsys.readouterr()
            assert f"ktlite: {idle}: torn down (idle " in listed.err, listed.err
            assert idle not in listed.out and kept in listed.out, listed.out
            line = next(line for line in listed.out.splitlines() if line.startswith(kept))
            assert " in 59m" in line, line  # its deadline: an hour after its last call
            assert _left(api, idle) == {}
            assert set(_left(api, kept)) == set(KINDS)
            assert cli.main(["teardown", "--expired"]) == 0
            assert "nothing has expired" in capsys.readouterr().out
        finally:
            for remote in (first, second):
                with contextlib.suppress(Exception):
                    remote.teardown()
