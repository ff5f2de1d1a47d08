"""One call path over the parsed pod spec: a call's plan (the ``x-ktlite-call`` header) is built
once, by ``ktlite.modes.callpath.CallPlans``, as the typed ``ktlite_wire.plan.CallPlan`` that the
pod decodes; and the call path reads the deployment's call defaults from its
``DeploymentSpec.pod``, which holds no ``kt.Compute``.

Real local pods (pod servers, rank processes); the client's ``call`` is wrapped only to keep a
copy of each plan it sends.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import fields
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends.base import PodEndpoint
from ktlite.errors import ConfigError
from ktlite.modes.callpath import CallOptions, CallPlans
from ktlite.modes.deploy import deploy
from ktlite.net import packaging
from ktlite.net.client import PodClient
from ktlite.specs.call_defaults import CallDefaults
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.podspec import PodSpec
from ktlite.specs.spec import DistributedConfig
from ktlite_wire.plan import CallPlan, decode_plan


def whoami(x: int, item: Any = None) -> list[Any]:
    return [int(os.environ["RANK"]), x, item]


def _name(what: str) -> str:
    return f"plan-{what}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[CallPlan]:
    """Every plan the client sends, as sent (after the shared-memory fields are set)."""
    plans: list[CallPlan] = []
    call = PodClient.call

    def keep(self: PodClient, url: str, plan: CallPlan, *args: Any, **kwargs: Any) -> Any:
        plans.append(plan)
        return call(self, url, plan, *args, **kwargs)

    monkeypatch.setattr(PodClient, "call", keep)
    return plans


def _round_trips(plan: CallPlan) -> CallPlan:
    """The plan as the pod decodes it from the header: equal to the one sent, field by field."""
    assert isinstance(plan, CallPlan)
    decoded = decode_plan(plan.encode())
    for f in fields(CallPlan):
        if f.name != "_pods_text":  # the sender's encoding of its pods' part, kept
            assert getattr(decoded, f.name) == getattr(plan, f.name), f.name
    return decoded


@pytest.mark.timeout(240)
def test_a_fanout_plan_round_trips_through_the_wire_decoder(sent: list[CallPlan]) -> None:
    compute = kt.Compute(call_timeout=90, stream_logs=False).distribute(
        "spmd", workers=2, num_proc=[1, 2]
    )
    remote = kt.fn(whoami, name=_name("spmd")).to(compute)
    try:
        assert remote(1) == [[0, 1, None], [1, 1, None], [2, 1, None]]
        assert remote.options(timeout=30, ranks=[2])(2) == [[2, 2, None]]
        assert remote.options(workers=[0])(3) == [[0, 3, None]]
        assert remote(4, item=kt.per_rank(["a", "b", "c"])) == [
            [0, 4, "a"],
            [1, 4, "b"],
            [2, 4, "c"],
        ]
    finally:
        remote.teardown()
    assert len(sent) == 4
    plain, ranked, picked, per_rank = (_round_trips(p) for p in sent)
    assert plain.fanout and len(plain.pods) == 2 and len(plain.names) == 2
    assert plain.num_proc == [1, 2] and plain.sizes == [1, 2]
    assert plain.timeout == 90 and plain.stream_logs is False  # the Compute's call defaults
    assert plain.workers is None and plain.ranks is None and plain.per_rank is None
    assert ranked.timeout == 30 and ranked.ranks == [2] and ranked.workers == [1]
    assert picked.workers == [0] and picked.ranks is None
    assert per_rank.per_rank is not None and len(per_rank.per_rank["items"]) == 3
    assert len({p.id for p in sent}) == 4 and len({p.launch_id for p in sent}) == 1


@pytest.mark.timeout(240)
def test_a_routed_plan_round_trips_through_the_wire_decoder(sent: list[CallPlan]) -> None:
    compute = kt.Compute(call_timeout=45).autoscale(min_scale=1, max_scale=1)
    remote = kt.fn(whoami, name=_name("routed")).to(compute)
    try:
        assert remote(5) == [0, 5, None]  # one replica, one value
        assert remote.options(timeout=20, stream_logs=False)(6) == [0, 6, None]
    finally:
        remote.teardown()
    assert len(sent) == 2
    first, second = (_round_trips(p) for p in sent)
    assert first.fanout and len(first.pods) == 1 and first.num_proc == 1
    assert first.timeout == 45 and first.stream_logs is True
    assert second.timeout == 20 and second.stream_logs is False
    assert first.workers is None and first.ranks is None and first.per_rank is None


@pytest.mark.timeout(240)
def test_a_deployment_of_a_pod_spec_alone_takes_its_call_defaults_from_it() -> None:
    """No kt.Compute anywhere: the launch, the calls and the teardown read ``spec.pod``."""
    pod = PodSpec(
        env={"PLAN_PROBE": "1"},
        calls=CallDefaults(launch_timeout=120, call_timeout=60, teardown_timeout=20),
        distributed=DistributedConfig(workers=1, num_proc=2),
    )
    spec = DeploymentSpec(_name("podonly"), pod)
    dep = deploy(spec, packaging.bundle(whoami), packaging.local_sources(), None)
    try:
        parts = packaging.encode_call(None, (7,), {})
        assert dep.call(None, parts, CallOptions()) == [[0, 7, None], [1, 7, None]]
    finally:
        dep.teardown()


def test_call_plan_takes_the_call_defaults_where_the_options_leave_them_open() -> None:
    spec = DeploymentSpec("defaults", kt.Compute(call_timeout=12, stream_logs=False).pod_spec())
    url = "http://127.0.0.1:1"
    eps = [PodEndpoint(name="defaults-0", ordinal=0, url=url, peer_url=url, ip="127.0.0.1")]
    plans = CallPlans()
    plan = plans.plan(spec, "l1", eps, CallOptions(), call_id="c1", num_proc=(1,))
    assert (plan.timeout, plan.stream_logs, plan.restart) == (12, False, False)
    assert plan.num_proc == [1] and plan.pods == [url] and plan.names == ["defaults-0"]
    assert _round_trips(plan) == plan
    mine = plans.plan(
        spec,
        "l1",
        eps,
        CallOptions(timeout=3, stream_logs=True, restart_procs=True),
        call_id="c2",
        num_proc=1,
    )
    assert (mine.timeout, mine.stream_logs, mine.restart) == (3, True, True)
    with pytest.raises(ConfigError, match="workers"):  # a plan the pod would refuse: here
        plans.plan(spec, "l1", eps, CallOptions(), call_id="c3", num_proc=1, workers=[4])
    with pytest.raises(ConfigError, match="timeout"):
        plans.plan(spec, "l1", eps, CallOptions(timeout=-1), call_id="c4", num_proc=1)


def _eps(n: int, port: int = 1) -> list[PodEndpoint]:
    return [
        PodEndpoint(
            name=f"p-{i}",
            ordinal=i,
            url=f"http://a{i}:{port}",
            peer_url=f"http://b{i}:{port}",
            ip=f"10.0.0.{i}",
        )
        for i in range(n)
    ]


def test_the_pods_part_of_a_plan_is_built_once_per_set_of_pods() -> None:
    """Calls to the same pods share the checked pods' part; a replaced pod (a new endpoint), a
    new launch or other ranks per pod build it again; each call's own fields are its own."""
    spec = DeploymentSpec("shared", kt.Compute().pod_spec())
    plans, eps = CallPlans(), _eps(3)
    first = plans.plan(spec, "l1", eps, CallOptions(), call_id="c1", num_proc=2)
    again = plans.plan(
        spec, "l1", list(eps), CallOptions(timeout=5), call_id="c2", num_proc=2, workers=[1, 2]
    )
    assert again.pods is first.pods and again.sizes is first.sizes  # shared, not rebuilt
    assert (again.id, again.timeout, again.workers, first.workers) == ("c2", 5.0, [1, 2], None)
    first.shm, first.shm_results = ["/dev/shm/x", 3], True  # set per call by shm_arguments
    third = plans.plan(spec, "l1", eps, CallOptions(), call_id="c3", num_proc=2)
    assert (third.shm, third.shm_results) == (None, False)
    replaced = [*eps[:2], _eps(3, port=2)[2]]
    moved = plans.plan(spec, "l1", replaced, CallOptions(), call_id="c4", num_proc=2)
    assert moved.pods[2] == "http://b2:2" and first.pods[2] == "http://b2:1"
    relaunched = plans.plan(spec, "l2", eps, CallOptions(), call_id="c5", num_proc=2)
    assert relaunched.launch_id == "l2" and relaunched.pods is not first.pods
    wider = plans.plan(spec, "l1", eps, CallOptions(), call_id="c6", num_proc=[1, 2, 3])
    assert wider.sizes == [1, 2, 3] and list(wider.pod_ranks(2)) == [3, 4, 5]


@pytest.mark.parametrize(
    "call",
    [
        {},
        {"timeout": 2.5, "stream_logs": False, "restart": True},
        {"workers": [0, 2], "ranks": [0, 5]},
        {"per_rank": {"shared": 4, "items": [[4, 1]] * 6}},
    ],
)
def test_a_plan_for_a_call_is_the_plan_built_whole(call: dict[str, Any]) -> None:
    """``for_call`` (the pods' part copied, the call's fields checked) gives the same plan, and
    the same header, as building and checking every field."""
    pods = {"pods": ["http://a", "http://b", "http://c"], "names": ["a", "b", "c"]}
    base = CallPlan(id="base", launch_id="l", fanout=True, num_proc=2, **pods)
    whole = CallPlan(id="c1", launch_id="l", fanout=True, num_proc=2, **pods, **call)
    assert base.for_call("c1", **call) == whole
    assert decode_plan(base.for_call("c1", **call).encode()) == decode_plan(whole.encode())
    assert len(base.for_call("c1", **call).encode()) == len(whole.encode())  # nothing more


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"stream_logs": "yes"}, "stream_logs"),
        ({"workers": [3]}, "workers"),
        ({"workers": []}, "workers"),
        ({"ranks": [True]}, "ranks"),
        ({"per_rank": {"shared": -1, "items": []}}, "per_rank"),
    ],
)
def test_a_plan_for_a_call_checks_the_call_fields(call: dict[str, Any], field: str) -> None:
    base = CallPlan(id="base", pods=["http://a", "http://b"], fanout=True)
    with pytest.raises(ValueError, match=field):
        base.for_call("c1", **call)
    with pytest.raises(ValueError, match="id"):
        base.for_call("")


def test_a_plan_encodes_only_what_is_not_its_default() -> None:
    plan = CallPlan(id="c", pods=["http://a"], fanout=True)
    assert plan.encode() == '{"id":"c","pods":["http://a"],"fanout":true}'
    assert decode_plan(plan.encode()) == plan
    with pytest.raises(ValueError, match="stream_logs"):
        CallPlan(id="c", stream_logs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="id"):
        decode_plan('{"pods": []}')


@pytest.mark.timeout(240)
def test_each_handle_keeps_the_compute_the_spec_no_longer_holds() -> None:
    """``remote.compute`` is the handle's own: the one deployed (after a redeploy, the new one),
    a colocated target's host's, and an attached-by-name handle's the layout the pods report."""
    compute = kt.Compute(call_timeout=50).distribute("spmd", workers=2)
    remote = kt.fn(whoami, name=_name("handle")).to(compute)
    try:
        assert remote.compute == compute and remote.compute is not compute  # its own copy
        guest = kt.fn(whoami, name="guest").to(remote)
        assert guest.compute is remote.compute
        attached = kt.fn(name=remote.name)
        assert attached.compute.distributed == compute.distributed
        assert attached.deployment.spec.pod.distributed == compute.distributed
        remote.distribute("spmd", workers=1)  # a redeploy from the handle
        assert remote.compute.distributed is not None
        assert remote.compute.distributed.workers == 1 and guest.compute is remote.compute
        assert remote.deployment.spec.pod.calls.call_timeout == 50
        attached.deployment.close()
    finally:
        remote.teardown()
    with pytest.raises(kt.NotDeployedError):
        remote.compute  # noqa: B018 - torn down, as before


def test_calls_with_the_same_options_share_one_checked_plan_each_with_its_own_id() -> None:
    spec = DeploymentSpec("plans", kt.Compute(cpus=1).pod_spec())
    url = "http://10.0.0.1:32300"
    ep = PodEndpoint(name="plans-0", ordinal=0, url=url, peer_url=url, ip="10.0.0.1")
    plans = CallPlans()
    a = plans.plan(spec, "l1", [ep], CallOptions(), call_id="a", num_proc=1)
    b = plans.plan(spec, "l1", [ep], CallOptions(), call_id="b", num_proc=1)
    assert (a.id, b.id) == ("a", "b") and a is not b
    b.shm_results = True  # a call's own change stays its own
    c = plans.plan(spec, "l1", [ep], CallOptions(), call_id="c", num_proc=1)
    assert not c.shm_results and not a.shm_results
    assert decode_plan(c.encode()) == c
    d = plans.plan(spec, "l1", [ep], CallOptions(timeout=5.0), call_id="d", num_proc=1)
    assert d.timeout == 5.0 and c.timeout is None
    with pytest.raises(kt.ConfigError, match="timeout"):
        plans.plan(spec, "l1", [ep], CallOptions(timeout=-1.0), call_id="e", num_proc=1)
    with pytest.raises(kt.ConfigError, match="timeout"):  # refused each time, never kept
        plans.plan(spec, "l1", [ep], CallOptions(timeout=-1.0), call_id="f", num_proc=1)
