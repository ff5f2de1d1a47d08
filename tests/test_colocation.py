"""Colocation (issue 10, item 6): ``kt.cls(Gen).to(policy)`` loads a second class (or a
``kt.fn``) into the rank processes of an existing deployment: same pods, same processes,
same torch.distributed default process group, calls in turn through the same deployment.

One 2 pods x 1 proc deployment is shared by the module; its tests run in file order.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

import ktlite as kt
from ktlite.errors import ConfigError, NotDeployedError, RemoteError

QUIET = {"stream_logs": False}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Policy:
    def __init__(self, lr=0.1):
        self.lr = lr
        self.steps = 0

    def init_group(self):
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        return dist.get_rank()

    def step(self):
        self.steps += 1
        return {
            "rank": int(os.environ["RANK"]),
            "pid": os.getpid(),
            "steps": self.steps,
            "lr": self.lr,
        }


class Generator:
    def __init__(self, temperature=1.0):
        self.temperature = temperature
        self.generated = 0

    def generate(self, prompt):
        self.generated += 1
        return {
            "rank": int(os.environ["RANK"]),
            "pid": os.getpid(),
            "n": self.generated,
            "text": f"{prompt}@{self.temperature}",
        }

    def all_reduce(self):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)  # the group policy's call initialised, in this same process
        return float(t.item())

    def die(self):
        os.kill(os.getpid(), signal.SIGKILL)


def whoami(tag):
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "tag": tag}


@pytest.fixture(scope="module")
def policy():
    remote = kt.cls(Policy, name=unique("policy")).to(
        kt.Compute(cpus=1).distribute("pytorch", workers=2, num_proc=1), init_args={"lr": 0.5}
    )
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def gen(policy):
    remote = kt.cls(Generator).to(policy, init_args={"temperature": 0.7})
    yield remote
    remote.teardown()


def test_same_processes_same_ranks(policy, gen):
    p = policy.step.options(**QUIET)()
    g = gen.generate.options(**QUIET)("hi")
    assert [r["rank"] for r in p] == [r["rank"] for r in g] == [0, 1]
    assert [r["pid"] for r in p] == [
        r["pid"] for r in g
    ]  # one process per rank, both targets in it
    assert len({r["pid"] for r in p}) == 2
    assert [r["text"] for r in g] == ["hi@0.7", "hi@0.7"]
    assert [r["lr"] for r in p] == [0.5, 0.5]
    # each keeps its own state
    assert [r["n"] for r in gen.generate.options(**QUIET)("x")] == [2, 2]
    assert [r["steps"] for r in policy.step.options(**QUIET)()] == [2, 2]
    assert "colocated as 'generator'" in repr(gen) and gen.target == "generator"


def test_shares_the_process_group(policy, gen):
    assert policy.init_group.options(**QUIET, timeout=90)() == [0, 1]
    assert gen.all_reduce.options(**QUIET, timeout=90)() == [3.0, 3.0]


def test_status_lists_targets(policy, gen):
    for st in (policy.status(), gen.status()):
        assert len(st) == 2
        for pod in st:
            assert pod["colocated"] == ["generator"]
            assert all(r["targets"] == ["generator"] for r in pod["ranks"])


def test_colocated_function(policy):
    f = kt.fn(whoami).to(policy)
    try:
        out = f.options(**QUIET)("t")
        pids = [r["pid"] for r in policy.step.options(**QUIET)()]
        assert [r["rank"] for r in out] == [0, 1] and [r["pid"] for r in out] == pids
    finally:
        f.teardown()
    with pytest.raises(NotDeployedError):
        f("t")


class Broken:
    def __init__(self):
        raise RuntimeError("no model here")


def test_failed_colocation_leaves_the_host_as_it_was(policy, gen):
    with pytest.raises(RuntimeError, match="no model here") as info:
        kt.cls(Broken).to(policy)
    context = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert isinstance(info.value, RemoteError) and "colocating 'broken'" in context
    assert [pod["colocated"] for pod in policy.status()] == [["generator"]] * 2
    assert len(policy.step.options(**QUIET)()) == 2


def test_host_teardown_removes_everything_then_bad_host_is_a_config_error():
    host = kt.fn(whoami, name=unique("host")).to(kt.Compute(cpus=1))
    g = kt.cls(Generator).to(host, init_args={"temperature": 3})
    pid = host("h")["pid"]
    out = g.generate("one")  # a single-rank host: one value, as the host's own calls
    assert out["pid"] == pid and out["text"] == "one@3"
    host.teardown()
    with pytest.raises(NotDeployedError, match="torn down"):
        g.generate("two")
    g.teardown()  # nothing left to remove: no error
    with pytest.raises(ConfigError, match=f"{host._source.name}.*torn down"):
        kt.cls(Generator).to(host)
    with pytest.raises(ConfigError, match="kt.Compute"):
        kt.cls(Generator).to("not a remote")  # only a deployed handle or a Compute


def test_teardown_of_the_colocated_leaves_the_host(policy, gen):
    extra = kt.cls(Generator, name="extra").to(policy, init_args=(2.0,))
    assert [r["text"] for r in extra.generate.options(**QUIET)("a")] == ["a@2.0", "a@2.0"]
    extra.teardown()
    assert "torn down" in repr(extra)
    with pytest.raises(NotDeployedError):
        extra.generate("a")
    assert [pod["colocated"] for pod in policy.status()] == [["generator"]] * 2
    assert len(policy.step.options(**QUIET)()) == 2


def test_redeploying_the_host_keeps_the_colocated(policy, gen):
    before = gen.generate.options(**QUIET)("k")
    policy.distribute("pytorch", workers=2, num_proc=1)  # the host's code pushed again, same layout
    after = gen.generate.options(**QUIET)("k")
    assert [r["pid"] for r in after] == [r["pid"] for r in before]
    assert [r["n"] for r in after] == [r["n"] + 1 for r in before]  # same instances
    assert [r["steps"] for r in policy.step.options(**QUIET)()] == [1, 1]  # the host's are new


def test_restart_procs_constructs_every_target_again(policy, gen):
    old = [r["pid"] for r in gen.generate.options(**QUIET)("r")]
    p = policy.step.options(**QUIET, restart_procs=True)()
    g = gen.generate.options(**QUIET)("r")
    assert [r["pid"] for r in g] == [r["pid"] for r in p] and set(old).isdisjoint(
        r["pid"] for r in g
    )
    assert [r["n"] for r in g] == [1, 1] and [r["steps"] for r in p] == [1, 1]


def test_rank_death_reloads_every_target(policy, gen):
    gen.generate.options(**QUIET)("warm")  # rank 0's instance has state to keep
    before = [r["pid"] for r in policy.step.options(**QUIET)()]
    with pytest.raises(RemoteError):
        gen.die.options(**QUIET, timeout=60, workers=[1])()
    deadline = time.monotonic() + 60
    while True:  # the rank restarts in the background, or before the next call
        try:
            p = policy.step.options(**QUIET, timeout=60)()
            break
        except RemoteError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    g = gen.generate.options(**QUIET, timeout=60)("again")
    assert p[0]["pid"] == before[0] and p[1]["pid"] != before[1]
    assert [r["pid"] for r in g] == [r["pid"] for r in p]
    # rank 1's instances are new ones, made with their init args; rank 0 kept its state
    assert p[1]["steps"] == 1 and p[1]["lr"] == 0.5
    assert g[1]["n"] == 1 and g[1]["text"] == "again@0.7" and g[0]["n"] > 1
