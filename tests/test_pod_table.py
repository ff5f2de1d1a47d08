"""The pod table of a deployment of several pods, asked of pod 0 alone (issue 26, item 3:
through a Kubernetes API server's proxy every request to a pod is an API request): ``status``
and ``restart_failed`` (``modes.podtable`` / ``ktlite_server.podtable``) and a colocation push
(relayed as the code push is), here down a call tree two levels deep (tree_minimum=2,
tree_fanout=2: pod 0 asks pods 1 and 3, pod 1 asks pod 2). Real pod servers and rank
processes (local backend); the caller's requests are counted by wrapping its client."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import ktlite as kt
from ktlite.commands import status_cli
from ktlite.modes.deploy import Deployment
from ktlite_wire.calltree import LaunchRelay

QUIET = {"stream_logs": False}


class Trainer:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])

    def pid(self, die_on: int | None = None) -> int:
        if self.rank == die_on:
            time.sleep(0.2)
            os._exit(7)
        return os.getpid()

    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # forms the group, or re-forms it after a restart
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())


class Helper:
    def rank(self) -> int:
        return int(os.environ["RANK"])


@pytest.fixture(scope="module")
def trainer() -> Iterator[Any]:
    compute = kt.Compute().distribute(
        "pytorch", workers=4, num_proc=1, tree_minimum=2, tree_fanout=2
    )
    remote = kt.cls(Trainer).to(compute, name="podtable")
    yield remote
    remote.teardown()


@contextlib.contextmanager
def asked(remote: Any) -> Iterator[list[tuple[str, str]]]:
    """The (method, pod URL) of every request the caller's client sends meanwhile."""
    client, seen = remote.deployment.client, []
    methods = ("status", "restart_failed", "deploy", "health")
    for name in methods:
        real = getattr(client, name)

        def spy(url: str, *args: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
            seen.append((_name, url))
            return _real(url, *args, **kw)

        setattr(client, name, spy)
    try:
        yield seen
    finally:
        for name in methods:
            delattr(client, name)


def test_status_of_every_pod_is_one_request_to_pod_0(trainer: Any) -> None:
    pod0 = trainer.deployment.endpoints[0].url
    with asked(trainer) as seen:
        table = trainer.status()
    assert seen == [("status", pod0)]
    assert [p["ordinal"] for p in table] == [0, 1, 2, 3]
    assert all(len(p["ranks"]) == 1 and "error" not in p for p in table)


def test_the_status_command_asks_pod_0_alone(trainer: Any) -> None:
    pod0 = trainer.deployment.endpoints[0].url
    with asked(trainer) as seen:
        table = status_cli.pods_status(trainer.deployment, None)
    assert seen == [("status", pod0)]
    assert [p["pod"] for p in table] == [ep.name for ep in trainer.deployment.endpoints]


def test_a_pod_that_pod_0_cannot_reach_is_an_entry_saying_so(trainer: Any) -> None:
    dep = trainer.deployment
    eps = dep.endpoints
    with socket_nobody_listens_on() as dead:
        pods = [ep.peer_url for ep in eps[:3]] + [dead]
        names = [ep.name for ep in eps]
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        relay = LaunchRelay(pods, names, [0, 1, 2, 3], 2, 5.0, py).encode()
        table = dep.client.status(eps[0].url, None, relay=relay, timeout=10)
    assert [p["ordinal"] for p in table] == [0, 1, 2, 3]
    assert all("error" not in p for p in table[:3])
    assert table[3]["pod"] == eps[3].name and table[3]["ranks"] == []
    assert f"pod {eps[3].name} could not be asked for /status" in table[3]["error"]


@contextlib.contextmanager
def socket_nobody_listens_on() -> Iterator[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_restart_failed_is_one_request_and_regroups(trainer: Any) -> None:
    assert trainer.all_reduce.options(**QUIET, timeout=90)() == [10.0] * 4
    before = trainer.pid.options(**QUIET)()
    with pytest.raises(kt.RankDied, match="rank 2"):
        trainer.pid.options(**QUIET, timeout=60)(die_on=2)  # pod 2: two levels down the tree
    pod0 = trainer.deployment.endpoints[0].url
    with asked(trainer) as seen:
        report = trainer.restart_failed()
    assert seen == [("restart_failed", pod0)]
    assert report["restarted"] == [2] and report["failed"] == []
    assert [a["ordinal"] for a in report["pods"]] == [0, 1, 2, 3]
    after = trainer.pid.options(**QUIET)()
    assert [a == b for a, b in zip(after, before, strict=True)] == [True, True, False, True]
    # pod 0 moved to a new process group: the survivors and the new rank form it together
    assert trainer.all_reduce.options(**QUIET, timeout=90)() == [10.0] * 4


def test_colocating_is_one_request_to_pod_0(trainer: Any) -> None:
    pod0 = trainer.deployment.endpoints[0].url
    with asked(trainer) as seen:
        helper = kt.cls(Helper).to(trainer)
    try:
        assert seen == [("deploy", pod0)]
        assert helper.rank.options(**QUIET)() == [0, 1, 2, 3]
        assert [p["colocated"] for p in trainer.status()] == [["helper"]] * 4
    finally:
        with asked(trainer) as seen:
            helper.teardown()
        assert seen == [("deploy", pod0)]  # removing it: relayed too
    assert [p["colocated"] for p in trainer.status()] == [[]] * 4


def test_the_status_command_asks_each_pod_when_pod_0_does_not_answer(trainer: Any) -> None:
    dep = trainer.deployment
    with socket_nobody_listens_on() as dead:
        eps = [dataclasses.replace(dep.endpoints[0], url=dead), *dep.endpoints[1:]]
        applied = dataclasses.replace(dep.applied, endpoints=eps)
        lost = Deployment(dep.spec, dep.backend, applied)
        table = status_cli.pods_status(lost, None)
    assert [p["ordinal"] for p in table] == [0, 1, 2, 3]
    assert "error" in table[0] and table[0]["ranks"] == []
    assert all("error" not in p and len(p["ranks"]) == 1 for p in table[1:])
    try:
        with pytest.raises(kt.PodUnreachable):
            lost.status()  # remote.status() raises, as with one pod that does not answer
    finally:
        lost.close()  # its own connections; the pods are the module's deployment's
