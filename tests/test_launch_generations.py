"""Ordered launch generations of a served deployment (``Compute.autoscale``).

Every ``.to()`` of a service takes the next generation where its launch is kept (the local
backend's deployment directory, the ``NAME-launch`` Secret on Kubernetes), in the same step
that writes the launch; a replica's server refuses a launch older than the one it holds
(``ErrorCode.STALE_LAUNCH``), so the newest ``.to()`` wins whatever order the pushes arrive
in, and a replica that booted from its launch file takes a newer one. A handle whose push is
refused learns it is stale and says so. The interleavings are driven by hand: launches pushed
straight to real pod servers in both orders, a stale handle's bring-up push made on cue.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.backends.local_scaling import LAUNCH_FILE
from ktlite.errors import KtliteError, StaleLaunch
from ktlite.net.client import PodClient
from ktlite.net.packaging import bundle
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.launch import Launch, decode_deploy
from tests.test_server_limits import WAIT, _wait_until, pod_server


def version() -> str:
    return "file"


def _launch(launch_id: str, generation: int) -> Launch:
    return Launch(
        launch_id=launch_id,
        bundle=bundle(version),
        kind="fn",
        distributed=DistributedLayout(),
        pod_ips=["127.0.0.1"],
        master_port=29500,
        single=True,
        replica=True,
        generation=generation,
    )


def _ready(client: PodClient, url: str) -> bool:
    try:
        return client.ready(url) is not None
    except KtliteError:  # not answering yet
        return False


# ---- the pod server decides the order -------------------------------------------------------


@pytest.mark.parametrize("order", [("older", "newer"), ("newer", "older")])
def test_the_newer_generation_wins_in_either_order(tmp_path: Path, order: tuple[str, str]) -> None:
    # two handles that both saw the replica without code push at once: whichever arrives
    # first, the replica ends with the newer .to()'s launch and refuses the older one
    launches = {"older": _launch("older", 1), "newer": _launch("newer", 2)}
    with pod_server(tmp_path, KTLITE_POD_ORDINAL="0") as server:
        client = PodClient(server.token)
        url = f"http://127.0.0.1:{server.port}"
        first, second = (launches[k] for k in order)
        assert client.deploy(url, first.encode(), WAIT)[0].status.name == "OK"
        if second.generation > first.generation:
            assert client.deploy(url, second.encode(), WAIT)[0].status.name == "OK"
        else:
            with pytest.raises(StaleLaunch) as refused:
                client.deploy(url, second.encode(), WAIT)
            said = str(refused.value)
            assert "holds launch newer of generation 2" in said
            assert "launch older has generation 1" in said and "call .to() again" in said
        health = client.health(url)
        assert (health["launch_id"], health["generation"]) == ("newer", 2)


def test_a_launch_is_sent_again_as_the_same_install_and_a_rival_of_its_generation_is_refused(
    tmp_path: Path,
) -> None:
    with pod_server(tmp_path, KTLITE_POD_ORDINAL="0") as server:
        client = PodClient(server.token)
        url = f"http://127.0.0.1:{server.port}"
        client.deploy(url, _launch("one", 3).encode(), WAIT)
        # a caller that lost the answer sends the same launch again: the same install
        assert client.deploy(url, _launch("one", 3).encode(), WAIT)[0].status.name == "OK"
        with pytest.raises(StaleLaunch, match="launch two claims the same generation 3"):
            client.deploy(url, _launch("two", 3).encode(), WAIT)
        # a plain deployment's launch (generation 0) is older than any served one
        with pytest.raises(StaleLaunch, match="generation 0, older"):
            client.deploy(url, _launch("plain", 0).encode(), WAIT)
        assert client.health(url)["launch_id"] == "one"


def test_a_booted_replica_refuses_an_older_launch_and_takes_a_newer_one(tmp_path: Path) -> None:
    # the launch file is read before the server takes requests: an older launch sent to the
    # replica while it boots (a stale handle saw it without code) is refused
    launch_file = tmp_path / "launch.pkl"
    launch_file.write_bytes(gzip.compress(_launch("file", 2).encode()))
    with pod_server(
        tmp_path, KTLITE_LAUNCH_FILE=str(launch_file), KTLITE_POD_ORDINAL="0"
    ) as server:
        client = PodClient(server.token)
        url = f"http://127.0.0.1:{server.port}"
        with pytest.raises(StaleLaunch, match="holds launch file of generation 2"):
            client.deploy(url, _launch("older", 1).encode(), WAIT)
        _wait_until(
            lambda: client.ready(url, timeout=WAIT) is not None,
            "the replica to load its launch file",
        )
        assert client.health(url)["launch_id"] == "file"
        # the same launch, sent by the handle that wrote the file, is the same install
        assert client.deploy(url, _launch("file", 2).encode(), WAIT)[0].status.name == "OK"
        # a file read before a newer .to() wrote it (a Secret's mount lags) is replaced
        client.deploy(url, _launch("newest", 3).encode(), WAIT)
        health = client.health(url)
        assert (health["launch_id"], health["generation"]) == ("newest", 3)
        with pytest.raises(StaleLaunch):
            client.deploy(url, _launch("file", 2).encode(), WAIT)
        assert client.health(url)["launch_id"] == "newest"


# ---- where the generations are given out ----------------------------------------------------


def test_local_write_launch_gives_every_writer_its_own_generation_and_keeps_the_newest() -> None:
    name = f"gens-{uuid.uuid4().hex[:6]}"
    backend = LocalBackend()
    try:
        # eight .to() at once (each lock taken on its own open file, as another process takes it)
        with concurrent.futures.ThreadPoolExecutor(8) as writers:
            written = list(
                writers.map(lambda i: backend.write_launch(name, _launch(f"l{i}", 0)), range(8))
            )
        assert sorted(w.generation for w in written) == list(range(1, 9))
        newest = max(written, key=lambda w: w.generation)
        kept = decode_deploy((backend._dir(name) / LAUNCH_FILE).read_bytes())
        assert isinstance(kept, Launch)
        assert (kept.launch_id, kept.generation) == (newest.launch_id, 8)
        # another process's backend goes on from there
        assert LocalBackend().write_launch(name, _launch("next", 0)).generation == 9
    finally:
        backend.teardown(name)


# ---- a stale handle, end to end -------------------------------------------------------------


def v1() -> str:
    return "v1"


def v2() -> str:
    return "v2"


def test_a_stale_handle_cannot_push_its_older_launch_and_says_it_is_stale() -> None:
    name = f"stale-{uuid.uuid4().hex[:6]}"
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=1, max_scale=2, concurrency=1, window="1s", scale_down_delay="600s"
    )
    first = kt.fn(v1, name=name).to(compute)
    second = None
    try:
        assert first() == "v1"
        old = first.deployment.mode
        old.scaler.stop()  # this test makes the first handle's next scaling step itself
        old.scaler.join(WAIT)
        second = kt.fn(v2, name=name).to(compute)
        dep = second.deployment
        # a second replica starts: it boots from the launch file, which holds the newer launch
        grown = dep.backend.scale(name, dep.applied.token, 2)
        booted = next(ep for ep in grown.endpoints if ep.ordinal == 1)
        _wait_until(lambda: _ready(dep.client, booted.url), "the new replica to boot")
        # the first handle sees it (a replica it does not route to) and sends its own launch
        # (a step whose 1 s look at the replica timed out on a busy machine is taken again, as
        # the scaling thread's next tick would)
        _wait_until(
            lambda: old.scaler._bring_up(booted) or old.pool.stale is not None,
            "the first handle's push to be refused",
        )
        with pytest.raises(kt.NotDeployedError, match="redeployed by another .to()") as stale:
            first()
        assert "generation 2" in str(stale.value) and "call .to() again" in str(stale.value)
        assert dep.client.health(booted.url)["launch_id"] == dep.launch_id
        assert second() == "v2"  # the newer launch runs everywhere
        assert second.status()["generation"] == 2
    finally:
        (second or first).teardown()


def test_a_to_overtaken_by_a_newer_one_fails_and_the_newer_code_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"race-{uuid.uuid4().hex[:6]}"
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=1, max_scale=1, concurrency=1, window="1s", scale_down_delay="600s"
    )
    backend = LocalBackend.shared()
    write = backend.write_launch
    newer: list[Any] = []

    def overtaken(service: str, launch: Launch) -> Launch:
        # this .to() took its generation; another .to() of the service runs whole before
        # this one pushes its launch to the replicas
        mine = write(service, launch)
        monkeypatch.setattr(backend, "write_launch", write)
        newer.append(kt.fn(v2, name=name).to(compute))
        return mine

    monkeypatch.setattr(backend, "write_launch", overtaken)
    try:
        with pytest.raises(StaleLaunch, match="generation 1, older than that"):
            kt.fn(v1, name=name).to(compute)
        assert newer and newer[0]() == "v2"
    finally:
        backend.teardown(name)


def test_attaching_by_name_routes_to_the_newest_generation() -> None:
    name = f"attach-{uuid.uuid4().hex[:6]}"
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=3, max_scale=3, concurrency=1, window="1s", scale_down_delay="600s"
    )
    first = kt.fn(v1, name=name).to(compute)
    try:
        dep, mode = first.deployment, first.deployment.mode
        mode.scaler.stop()  # nothing but this test sends launches
        mode.scaler.join(WAIT)
        # a rollout under way: the newest .to()'s launch reached one replica of three
        assert mode.pool.launch is not None
        rolled = dep.backend.write_launch(
            name, replace(mode.pool.launch, launch_id="newest", bundle=bundle(v2))
        )
        last = max(dep.applied.endpoints, key=lambda ep: ep.ordinal)
        dep.client.deploy(last.url, rolled.encode(), WAIT)
        attached = kt.fn(name=name)
        assert attached.deployment.launch_id == "newest"
        assert attached() == "v2"
    finally:
        first.teardown()
