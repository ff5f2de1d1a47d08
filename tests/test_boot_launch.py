"""A replica that boots from its launch file keeps that launch against an older one.

An autoscaled replica loads the launch the client left in its launch file (a Kubernetes
Secret) as it starts. A handle that an older ``.to()`` made may still look at the replicas
and send its launch to one it saw without code; that launch says what it expects the pod to
run (``Launch.expect``), and the pod refuses it once it took another (here: from its file),
instead of replacing the newer code (the stand-in cluster's e2e test lost that race).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from ktlite.errors import KtliteError
from ktlite.net.client import PodClient
from ktlite.net.packaging import bundle
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.launch import Launch
from tests.test_server_limits import WAIT, _wait_until, pod_server


def version() -> str:
    return "file"


def _launch(launch_id: str, **kw: object) -> Launch:
    return Launch(
        launch_id=launch_id,
        bundle=bundle(version),
        kind="fn",
        distributed=DistributedLayout(),
        pod_ips=["127.0.0.1"],
        master_port=29500,
        single=True,
        replica=True,
        **kw,
    )  # type: ignore[arg-type]


def test_a_booted_replica_refuses_an_older_launch_sent_to_a_pod_without_code(
    tmp_path: Path,
) -> None:
    launch_file = tmp_path / "launch.pkl"
    launch_file.write_bytes(gzip.compress(_launch("newer").encode()))
    with pod_server(
        tmp_path, KTLITE_LAUNCH_FILE=str(launch_file), KTLITE_POD_ORDINAL="0"
    ) as server:
        client = PodClient(server.token)
        url = f"http://127.0.0.1:{server.port}"
        # sent as a stale handle sends it: to a pod it saw without a launch
        with pytest.raises(KtliteError, match="redeployed"):
            client.deploy(url, _launch("older", expect="").encode(), WAIT)
        _wait_until(
            lambda: client.ready(url, timeout=WAIT) is not None,
            "the replica to load its launch file",
        )
        assert client.health(url)["launch_id"] == "newer"
        # the same launch, sent again by the handle that wrote the file, is the same install
        assert client.deploy(url, _launch("newer", expect="").encode(), WAIT)[0].status.name == "OK"
        # a handle that saw the replica run "newer" may replace it (one booted from a stale file)
        client.deploy(url, _launch("newest", expect="newer").encode(), WAIT)
        assert client.health(url)["launch_id"] == "newest"
        with pytest.raises(KtliteError, match="redeployed"):
            client.deploy(url, _launch("older", expect="newer").encode(), WAIT)
        assert client.health(url)["launch_id"] == "newest"
