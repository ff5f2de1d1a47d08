"""The call tree's shape and messages (``ktlite_wire.calltree``), and a relayed launch's failures."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from dataclasses import asdict

import pytest

from ktlite.specs.spec import TREE_FANOUT, TREE_MINIMUM, DistributedConfig
from ktlite_wire import codec, envelope
from ktlite_wire.calltree import (
    LaunchRelay,
    depth,
    relay_header,
    relay_meta,
    split,
    subtree_body,
)
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.plan import CallPlan, decode_plan
from ktlite_wire.status import Status


def _covers(pods: int, fanout: int) -> list[int]:
    """Every pod reached once, walking the tree from pod 0."""
    seen, todo = [0], [list(range(pods))]
    while todo:
        sub = todo.pop()
        for child in split(sub[1:], fanout):
            assert len(child) >= 1
            seen.append(child[0])
            todo.append(child)
    return sorted(seen)


@pytest.mark.parametrize("pods,fanout", [(7, 2), (1000, 16), (33, 16), (5, 8), (2, 1)])
def test_every_pod_is_reached_once_by_contiguous_subtrees(pods: int, fanout: int) -> None:
    assert _covers(pods, fanout) == list(range(pods))
    parts = split(list(range(1, pods)), fanout)
    assert len(parts) == min(fanout, pods - 1)
    assert [i for part in parts for i in part] == list(range(1, pods))  # in order, contiguous
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_depth_is_logarithmic() -> None:
    assert split([1, 2, 3, 4, 5, 6], 2) == [[1, 2, 3], [4, 5, 6]]
    assert depth(1, 16) == 0 and depth(17, 16) == 1 and depth(7, 2) == 2
    assert depth(1000, 16) == 3 and depth(1000, 999) == 1


def test_the_defaults_and_who_uses_the_tree() -> None:
    d = DistributedConfig(workers=1000, num_proc=8)
    assert d.tree(1000) == TREE_FANOUT and d.tree(TREE_MINIMUM - 1) == 0
    mine = DistributedConfig(workers=7, tree_fanout=2, tree_minimum=2)
    assert mine.tree(7) == 2 and mine.tree(1) == 0
    with pytest.raises(Exception, match="tree_fanout"):
        DistributedConfig(workers=7, tree_fanout=0)
    # the wire's layout carries them as the client has them (a pod rebuilds it from JSON)
    assert asdict(DistributedLayout.from_json(json.loads(json.dumps(asdict(mine))))) == asdict(mine)


def _plan(**kw: object) -> CallPlan:
    return CallPlan(
        id="c1",
        pods=[f"http://p{i}" for i in range(7)],
        names=[f"n-{i}" for i in range(7)],
        fanout=True,
        num_proc=2,
        **kw,  # type: ignore[arg-type]
    )


def test_a_relay_plan_names_its_subtree_and_decodes_on_the_pod() -> None:
    plan = _plan(tree=2)
    plan.generation, plan.group_port = 3, 29600
    meta = relay_meta(plan, [1, 2, 3], None)
    text = relay_header(plan, [1, 2, 3], None)
    assert json.loads(text) == meta
    got = decode_plan(text)
    assert got.fanout and list(got.ordinals()) == [1, 2, 3] and got.workers is None
    assert got.tree == 2 and got.id == "c1" and got.generation == 3 and got.group_port == 29600
    assert got.pods == plan.pods[1:4] and got.names == plan.names[1:4] and got.num_proc == 2
    assert [got.url(i) for i in (1, 2, 3)] == plan.pods[1:4]
    with pytest.raises(ValueError, match="tree"):
        _plan(tree=-1)


def _pods(n: int, num_proc: int | list[int] = 8) -> CallPlan:
    return CallPlan(
        id="c1",
        pods=[f"http://10.0.{i // 250}.{i % 250}:32300" for i in range(n)],
        names=[f"job-{i}" for i in range(n)],
        fanout=True,
        num_proc=num_proc,
        tree=32,
    )


def _same_pods(got: CallPlan, plan: CallPlan, ordinals: list[int]) -> None:
    for i in ordinals:
        assert (got.url(i), got.name(i), got.pod_ranks(i)) == (
            plan.url(i),
            plan.name(i),
            plan.pod_ranks(i),
        )


def test_a_relay_plan_carries_its_subtrees_pods_not_every_pod() -> None:
    """At a thousand pods the whole pod list is 45 KB: pod 0 wrote it into each of its 32
    children's plans and each relay parsed it. A relay gets its subtree's pods only."""
    plan = _pods(1000)
    subtree = split(list(range(1, 1000)), 32)[5]  # a relay in the middle
    text = relay_header(plan, subtree, None)
    assert len(text) < 3000, len(text)  # 32 pods' addresses and names, not 1,000
    got = decode_plan(text)
    assert got.first_pod == subtree[0] and len(got.pods) == len(subtree)
    assert got.first_rank == subtree[0] * 8 and got.workers is None
    _same_pods(got, plan, subtree)
    with pytest.raises(IndexError):
        got.url(subtree[-1] + 1)  # a pod outside its subtree is not in it
    # a relay's own children (a deeper tree) get windows of its window, the same pods
    deeper = decode_plan(relay_header(got, subtree[5:9], None))
    assert list(deeper.ordinals()) == subtree[5:9]
    _same_pods(deeper, plan, subtree[5:9])
    # a relayed code push's header too
    push = LaunchRelay(plan.pods, plan.names, list(range(1000)), 32, 60.0)
    below = LaunchRelay.decode(push.below(subtree).encode())
    assert len(below.encode()) < 3000 and below.first == subtree[0]
    assert [(below.url(i), below.name(i)) for i in subtree] == [
        (plan.url(i), plan.name(i)) for i in subtree
    ]


def test_a_relay_plan_keeps_uneven_ranks_and_the_callers_workers() -> None:
    sizes = [1 + i % 3 for i in range(40)]
    plan = _pods(40, sizes)
    got = decode_plan(relay_header(plan, list(range(20, 30)), None))
    assert got.num_proc == sizes[20:30] and got.first_rank == sum(sizes[:20])
    _same_pods(got, plan, list(range(20, 30)))
    # workers=[...] of the caller: a subtree of them skips pods, and names the ones it has
    picked = decode_plan(relay_header(plan, [3, 7, 8, 12], None))
    assert picked.workers == [3, 7, 8, 12] and list(picked.ordinals()) == list(range(3, 13))
    _same_pods(picked, plan, [3, 7, 8, 12])
    with pytest.raises(ValueError, match="workers"):
        CallPlan(id="c", pods=["a", "b"], first_pod=5, workers=[1])  # not among its pods
    with pytest.raises(ValueError, match="first_pod"):
        CallPlan(id="c", pods=["a", "b"], first_pod=-1)


def test_a_per_rank_body_is_cut_to_the_subtree_and_reads_back() -> None:
    items = [codec.dumps(f"item {r}") for r in range(14)]
    shared = codec.dumps("shared")
    body = envelope.join([shared, *items])
    offsets, pos = [], len(shared)
    for it in items:
        offsets.append([pos, len(it)])
        pos += len(it)
    plan = _plan(tree=2, per_rank={"shared": len(shared), "items": offsets, "base": 0})
    per_rank, parts = subtree_body(plan, [4, 5, 6], memoryview(body))
    cut = b"".join(bytes(p) for p in parts)
    assert per_rank is not None and per_rank["base"] == 8  # pod 4's first rank
    for r in range(8, 14):
        off, n = per_rank["items"][r - 8]
        assert codec.loads(cut[off : off + n]) == f"item {r}"
    assert codec.loads(cut[: per_rank["shared"]]) == "shared"


def test_a_launch_relay_header_round_trips_and_refuses_nonsense() -> None:
    relay = LaunchRelay(["http://a", "http://b"], ["a", "b"], [0, 1], 16, 300.0)
    assert LaunchRelay.decode(relay.encode()) == relay
    assert relay.below([1]).subtree == [1]
    assert relay.below([1]) == LaunchRelay(["http://b"], ["b"], [1], 16, 300.0, first=1)
    assert LaunchRelay.decode(relay.below([1]).encode()).url(1) == "http://b"
    for bad in (
        '{"pods": 1}',
        "[]",
        '{"pods":["x"],"names":["x"],"subtree":[5],"fanout":2,"timeout":1}',
        '{"pods":["x"],"names":["x"],"subtree":[0],"fanout":2,"timeout":1,"first":3}',
        '{"pods":["x"],"names":["x"],"subtree":[3],"fanout":2,"timeout":1,"first":-1}',
    ):
        with pytest.raises(ValueError):
            LaunchRelay.decode(bad)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_a_relayed_launch_names_a_child_that_never_listens_with_its_whole_subtree() -> None:
    from ktlite_server.launchtree import relay
    from ktlite_server.peers import PeerPool

    port = _closed_port()
    pods = ["http://127.0.0.1:1"] + [f"http://127.0.0.1:{port}"] * 3
    tree = LaunchRelay(pods, [f"p-{i}" for i in range(4)], [0, 1, 2, 3], 1, 0.5)
    layout = DistributedLayout(workers=4, num_proc=2)
    got = asyncio.run(relay(PeerPool(), tree, layout, b"launch"))
    assert got.subtrees == []  # no child answered
    outs = got.outcomes
    # fan-out 1: pod 0 relays to pod 1 only, which would relay to 2, then 3
    assert sorted(o.rank for o in outs) == list(range(2, 8))
    assert {o.status for o in outs} == {Status.DIED}
    assert all("pod p-1 at" in o.message and "not reachable" in o.message for o in outs)
    assert "2 pod(s) it relays the launch to" in outs[0].message


def test_a_pod_on_another_python_refuses_a_relayed_launch() -> None:
    from ktlite_server.launchtree import python_mismatch

    layout = DistributedLayout(workers=2, num_proc=2)
    same = f"{sys.version_info.major}.{sys.version_info.minor}"
    tree = LaunchRelay(["http://a", "http://b"], ["a", "b"], [1], 2, 5.0, same)
    assert python_mismatch(tree, layout, 1) is None
    other = LaunchRelay(["http://a", "http://b"], ["a", "b"], [1], 2, 5.0, "2.7")
    outs = python_mismatch(other, layout, 1)
    assert outs is not None and [o.rank for o in outs] == [2, 3]
    assert "Python 2.7" in outs[0].message and outs[0].pod == "b"


def test_a_relayed_launch_passes_a_childs_answer_on_as_it_came() -> None:
    """A child's answer to a relayed push is nested in its relay's result byte for byte (its
    head read for the summary, no outcome decoded), as a call's is."""
    from served_app import Served
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from ktlite_server.launchtree import relay
    from ktlite_server.peers import PeerPool
    from ktlite_wire.outcome import LIFT_MAX, CallResult, RankOutcome

    # a subtree's answer too large to lift: one row per rank, each its own failure
    outs = [RankOutcome(r, "p-1", Status.DIED, None, f"rank {r}", 1.0) for r in range(LIFT_MAX + 1)]
    answer = CallResult(outs).encode_bytes()
    asked: list[str] = []

    async def deploy(request: Request) -> Response:
        asked.append(request.headers["x-ktlite-tree"])
        return Response(answer, media_type="application/octet-stream")

    served = Served(Starlette(routes=[Route("/deploy", deploy, methods=["POST"])]), None, "t")
    try:
        tree = LaunchRelay(["http://127.0.0.1:1", served.url], ["p-0", "p-1"], [0, 1], 1, 5.0)
        layout = DistributedLayout(workers=2, num_proc=LIFT_MAX + 1)

        async def push() -> CallResult:
            peers = PeerPool()
            try:
                return await relay(peers, tree, layout, b"launch")
            finally:
                await peers.aclose()

        got = asyncio.run(push())
    finally:
        served.stop()
    assert got.outcomes == [] and [bytes(s.data) for s in got.subtrees] == [answer]
    assert LaunchRelay.decode(asked[0]) == tree.below([1])  # its own pod, not every pod
