"""Real-process tests of kt.fn on the local backend (issue 2, points 1, 2, 4, 8 and 9).

Every pod here is a real ``python -m ktlite_server`` process with real rank processes; no
mocks. Deployments are shared through module-scoped fixtures where the tests only read
from them, and each gets a unique name so parallel workers never collide.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import helpers_mod
import numpy as np
import pytest
from helpers_mod import Scaler, double
from loadscale import time_scale

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.backends.processes import pid_alive as alive

# ---- helpers (local side) -----------------------------------------------------------------

RANK_KEYS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "POD_IPS",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_RUN_ID",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "TF_CONFIG",
    "KTLITE_POD_NAME",
    "FOO",
)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def state_file(name: str) -> Path:
    return Path(os.environ["KTLITE_HOME"]) / "local" / name / "state.json"


def server_pids(name: str) -> list[int]:
    """The pod server pids of a local deployment, from its state.json."""
    state = json.loads(state_file(name).read_text())
    return [p["pid"] for p in sorted(state["pods"], key=lambda p: p["ordinal"])]


def rank_pids(remote: Any) -> list[int]:
    return [r["pid"] for pod in remote.status() for r in pod["ranks"]]


def wait_gone(pids: list[int], timeout: float = 3.0) -> list[int]:
    """Wait up to ``timeout`` s for every pid to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def digest(x: Any) -> str:
    """sha256 of an array's or tensor's raw bytes (bf16 hashed through an int16 view)."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        arr = t.numpy()
    else:
        arr = np.ascontiguousarray(x)
    return hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()


# ---- functions that run on the pods --------------------------------------------------------


def add_and_env(a, b, *rest, scale=1, **extra):
    return {
        "sum": (a + b + sum(rest)) * scale,
        "a": a,
        "b": b,
        "rest": list(rest),
        "scale": scale,
        "extra": extra,
        "foo": os.environ.get("FOO"),
        "pid": os.getpid(),
    }


def rank_env():
    return {"env": {k: os.environ.get(k) for k in RANK_KEYS}, "pid": os.getpid()}


def gloo_job(kind: str, steps: int = 2):
    """torch.distributed exactly as a user writes it: init with no arguments, then work."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "all_reduce":
        t = torch.tensor([float(rank + 1), 1.0])
        dist.all_reduce(t)
        return {
            "rank": rank,
            "world": world,
            "env_rank": int(os.environ["RANK"]),
            "sum": t.tolist(),
        }
    torch.manual_seed(0)  # identical initial weights; DDP also broadcasts rank 0's
    model = torch.nn.Linear(4, 2)
    initial = [p.detach().clone().tolist() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank sees different data
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.barrier()
    dist.destroy_process_group()  # what users write at the end of a training function
    return {
        "rank": rank,
        "world": world,
        "losses": losses,
        "initial": initial,
        "weights": [p.detach().tolist() for p in model.parameters()],
    }


def uses_helpers(x):
    import helpers_mod as inner  # imported on the pod, from the shipped source

    return {
        "double": double(x),
        "scaled": Scaler(3)(x),
        "inner_double": inner.double(x),
        "describe": inner.describe(),
        "top_level": helpers_mod.GREETING,
    }


def version_one():
    return ("v1", os.getpid(), os.environ.get("FOO"))


def version_two():
    return ("v2", os.getpid(), os.environ.get("FOO"))


def whoami():
    return {
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "world": os.environ.get("WORLD_SIZE"),
    }


def echo_with_digest(x):
    meta = {
        "digest": digest(x),
        "type": f"{type(x).__module__}.{type(x).__qualname__}",
        "dtype": str(x.dtype),
        "shape": tuple(x.shape),
    }
    if hasattr(x, "requires_grad"):
        meta["requires_grad"] = bool(x.requires_grad)
    return meta, x


def make_big(kind: str, nbytes: int, seed: int):
    if kind == "numpy":
        return np.random.default_rng(seed).standard_normal(nbytes // 8)
    import torch

    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


# ---- 1. a single call ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def single():
    remote = kt.fn(add_and_env, name=unique("single")).to(
        kt.Compute(cpus=1, memory="1Gi", env={"FOO": "bar"})
    )
    yield remote
    remote.teardown()


def test_single_call_returns_value_and_sees_env(single):
    out = single(2, 3)
    assert out["sum"] == 5
    assert out["foo"] == "bar"
    assert out["pid"] != os.getpid()
    assert alive(out["pid"])


def test_single_call_passes_args_and_kwargs(single):
    out = single(1, 2, 3, 4, scale=10, color="red", nested={"k": [1, 2]})
    assert out["sum"] == 100
    assert (out["a"], out["b"], out["rest"], out["scale"]) == (1, 2, [3, 4], 10)
    assert out["extra"] == {"color": "red", "nested": {"k": [1, 2]}}
    out = single(b=7, a=1)
    assert (out["a"], out["b"], out["sum"]) == (1, 7, 8)


def test_single_call_runs_in_a_long_lived_rank_process(single):
    assert single(0, 0)["pid"] == single(0, 0)["pid"]


# ---- 2. distributed ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_env():
    remote = kt.fn(rank_env, name=unique("ptenv")).to(
        kt.Compute(cpus=1, env={"FOO": "bar"}).distribute("pytorch", workers=2, num_proc=2)
    )
    yield remote
    remote.teardown()


def test_pytorch_env_on_every_rank(torch_env):
    results = torch_env()
    assert isinstance(results, list) and len(results) == 4
    ports = set()
    for r, res in enumerate(results):
        env = res["env"]
        node, local = divmod(r, 2)
        assert env["RANK"] == str(r), f"results[{r}] came from RANK {env['RANK']}"
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(local)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == str(node)
        assert env["GROUP_RANK"] == str(node)
        ips = env["POD_IPS"].split(",")
        assert len(ips) == 2 and all(ips)
        assert env["MASTER_ADDR"] == ips[0]
        assert int(env["MASTER_PORT"]) > 0
        ports.add(env["MASTER_PORT"])
        assert env["OMP_NUM_THREADS"] and int(env["OMP_NUM_THREADS"]) >= 1
        assert env["TORCHELASTIC_RUN_ID"]
        assert env["FOO"] == "bar"
        assert env["KTLITE_POD_NAME"] == f"{torch_env.name}-{node}"
        assert env["JAX_PROCESS_ID"] is None and env["TF_CONFIG"] is None
    assert len(ports) == 1, "every rank must agree on MASTER_PORT"
    assert len({res["env"]["TORCHELASTIC_RUN_ID"] for res in results}) == 1
    assert len({res["pid"] for res in results}) == 4


def test_ranks_are_stable_and_follow_pod_ordinals(torch_env):
    first = torch_env()
    second = torch_env()
    assert [r["pid"] for r in first] == [r["pid"] for r in second]
    assert [r["env"]["RANK"] for r in second] == ["0", "1", "2", "3"]
    # the process that answered as RANK r is pod (r // P)'s local rank (r % P)
    status = torch_env.status()
    assert [pod["ordinal"] for pod in status] == [0, 1]
    for pod in status:
        for rk in pod["ranks"]:
            assert rk["rank"] == pod["ordinal"] * 2 + rk["local_rank"]
            assert first[rk["rank"]]["pid"] == rk["pid"]


def test_jax_env():
    remote = kt.fn(rank_env, name=unique("jaxenv")).to(
        kt.Compute(cpus=1).distribute("jax", workers=2, num_proc=1)
    )
    try:
        results = remote()
    finally:
        remote.teardown()
    assert len(results) == 2
    for r, res in enumerate(results):
        env = res["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "2"
        assert env["JAX_COORDINATOR_ADDRESS"] == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        assert env["JAX_NUM_PROCESSES"] == "2"
        assert env["JAX_PROCESS_ID"] == str(r)
        assert env["MASTER_ADDR"] == env["POD_IPS"].split(",")[0]
        assert env["TF_CONFIG"] is None and env["TORCHELASTIC_RUN_ID"] is None
    assert (
        results[0]["env"]["JAX_COORDINATOR_ADDRESS"] == results[1]["env"]["JAX_COORDINATOR_ADDRESS"]
    )


def test_tensorflow_env():
    remote = kt.fn(rank_env, name=unique("tfenv")).to(
        kt.Compute(cpus=1).distribute("tensorflow", workers=2, num_proc=2)
    )
    try:
        results = remote()
    finally:
        remote.teardown()
    assert len(results) == 4
    configs = [json.loads(res["env"]["TF_CONFIG"]) for res in results]
    cluster = configs[0]["cluster"]
    assert list(cluster) == ["worker"]
    assert len(cluster["worker"]) == 4
    assert len(set(cluster["worker"])) == 4, "each rank needs its own address"
    ips = results[0]["env"]["POD_IPS"].split(",")
    for r, cfg in enumerate(configs):
        assert cfg["cluster"] == cluster
        assert cfg["task"] == {"type": "worker", "index": r}
        host, port = cfg["cluster"]["worker"][r].rsplit(":", 1)
        assert host == ips[r // 2] and int(port) > 0
        assert results[r]["env"]["RANK"] == str(r)
        assert results[r]["env"]["JAX_PROCESS_ID"] is None


@pytest.fixture(scope="module")
def gloo():
    remote = kt.fn(gloo_job, name=unique("gloo")).to(
        kt.Compute(cpus=1).distribute("pytorch", workers=2, num_proc=2)
    )
    yield remote
    remote.teardown()


def test_gloo_all_reduce_across_4_ranks(gloo):
    results = gloo("all_reduce")
    assert len(results) == 4
    for r, res in enumerate(results):
        assert res["rank"] == r and res["env_rank"] == r and res["world"] == 4
        assert res["sum"] == [1.0 + 2.0 + 3.0 + 4.0, 4.0]


def _check_ddp(results: list[dict[str, Any]]) -> None:
    assert [res["rank"] for res in results] == [0, 1, 2, 3]
    assert all(res["world"] == 4 for res in results)
    weights = results[0]["weights"]
    for res in results[1:]:
        assert res["weights"] == weights, "DDP must leave identical weights on every rank"
    assert weights != results[0]["initial"], "the training step changed nothing"
    assert len({tuple(res["losses"]) for res in results}) == 4, "every rank trained on its own data"


def test_ddp_step_gives_identical_weights(gloo):
    _check_ddp(gloo("ddp"))


def test_ddp_function_called_twice_in_a_row(gloo):
    pids = rank_pids(gloo)
    first = gloo("ddp", steps=1)
    second = gloo("ddp", steps=3)
    _check_ddp(first)
    _check_ddp(second)
    assert [len(r["losses"]) for r in second] == [3] * 4
    assert rank_pids(gloo) == pids, "the rank processes (and their process group) live across calls"
    assert [r["sum"][0] for r in gloo("all_reduce")] == [10.0] * 4


def test_ddp_after_a_code_only_redeploy(gloo):
    """.to() again with the same compute reuses the pods (and their process group)."""
    servers = server_pids(gloo.name)
    again = kt.fn(gloo_job, name=gloo.name).to(gloo.compute)
    _check_ddp(again("ddp"))
    assert [r["sum"][0] for r in again("all_reduce")] == [10.0] * 4
    assert server_pids(gloo.name) == servers


def test_seed_form_to_then_distribute():
    remote = kt.fn(whoami, name=unique("seed")).to(kt.Compute(cpus=1))
    try:
        single_value = remote()
        assert isinstance(single_value, dict)
        pod0 = server_pids(remote.name)
        same = remote.distribute("pytorch", workers=2)
        assert same is remote
        results = remote()
        assert isinstance(results, list) and len(results) == 2
        assert [r["rank"] for r in results] == ["0", "1"]
        assert all(r["world"] == "2" for r in results)
        assert server_pids(remote.name)[0] == pod0[0], "pod 0's spec did not change: it is reused"
    finally:
        remote.teardown()


# ---- 4. code shipping ----------------------------------------------------------------------


def test_function_from_local_test_module():
    assert add_and_env.__module__ == "test_local_calls"
    remote = kt.fn(add_and_env, name=unique("localmod")).to(kt.Compute(cpus=1))
    try:
        assert remote(20, 22)["sum"] == 42
    finally:
        remote.teardown()


def test_helper_module_shipped_by_value():
    remote = kt.fn(uses_helpers, name=unique("helpers")).to(kt.Compute(cpus=1))
    try:
        out = remote(21)
    finally:
        remote.teardown()
    assert out["double"] == 42
    assert out["scaled"] == 63
    assert out["inner_double"] == 42
    assert out["top_level"] == helpers_mod.GREETING
    assert out["describe"]["greeting"] == helpers_mod.GREETING
    assert out["describe"]["module"] == "helpers_mod"
    assert out["describe"]["pid"] != os.getpid()


def test_redeploy_new_code_onto_running_pods():
    name = unique("redeploy")
    compute = kt.Compute(cpus=1, env={"FOO": "one"})
    r1 = kt.fn(version_one, name=name).to(compute)
    try:
        assert r1()[0] == "v1"
        servers, ranks = server_pids(name), rank_pids(r1)
        assert len(servers) == 1 and len(ranks) == 1
        r2 = kt.fn(version_two, name=name).to(compute)
        r1.deployment.close()  # see test_replaced_handle_does_not_leak_sockets
        tag, _, foo = r2()
        assert tag == "v2" and foo == "one"
        assert server_pids(name) == servers, "code-only change must not start new pod processes"
        assert rank_pids(r2) == ranks, "code-only change reloads the code into the rank processes"
        assert all(alive(p) for p in servers)
        # a pod-spec change (env) restarts the pod
        r3 = kt.fn(version_two, name=name).to(kt.Compute(cpus=1, env={"FOO": "two"}))
        r2.deployment.close()
        tag, _, foo = r3()
        assert (tag, foo) == ("v2", "two")
        new_servers = server_pids(name)
        assert set(new_servers).isdisjoint(servers)
        assert wait_gone(servers) == []
    finally:
        LocalBackend.shared().teardown(name, timeout=5)


def read_module_value(module_name):
    import importlib

    return importlib.import_module(module_name).VALUE  # what `import helpers` in the body does


def test_redeploy_picks_up_an_edited_local_module(tmp_path, monkeypatch):
    """Edit a local helper module, call .to() again: the next call sees the edit, even
    though the rank process (which imported the old version) is reused."""
    module_name = f"edited_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{module_name}.py"
    path.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(module_name)
    name = unique("edited")
    compute = kt.Compute(cpus=1)
    remote = kt.fn(read_module_value, name=name).to(compute)
    try:
        assert remote(module_name) == 1
        path.write_text("VALUE = 22  # edited\n")
        importlib.invalidate_caches()
        importlib.reload(module)
        assert module.VALUE == 22
        remote.deployment.close()
        remote = kt.fn(read_module_value, name=name).to(compute)
        assert remote(module_name) == 22, "the pod still runs the old version of the module"
    finally:
        remote.teardown()
        monkeypatch.delitem(sys.modules, module_name, raising=False)


def test_replaced_handle_does_not_leak_sockets():
    """The edit-and-redeploy loop rebinds ``remote = kt.fn(f).to(c)``: the old handle is
    dropped without a teardown (the pods live on) and must not leak its connections."""
    name = unique("rebind")
    remote = kt.fn(version_one, name=name).to(kt.Compute(cpus=1))
    try:
        assert remote()[0] == "v1"
        assert rank_pids(remote)  # a plain request leaves a pooled keep-alive connection
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            remote = kt.fn(version_two, name=name).to(kt.Compute(cpus=1))
            gc.collect()
        assert remote()[0] == "v2"
        leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert leaks == [], "dropping a replaced handle leaked: " + "; ".join(leaks)
    finally:
        remote.teardown()


# ---- 8. teardown and process lifetime ------------------------------------------------------


def test_teardown_stops_everything_and_redeploy_starts_fresh():
    name = unique("teardown")
    compute = kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=2)
    remote = kt.fn(whoami, name=name).to(compute)
    assert len(remote()) == 4
    servers, ranks = server_pids(name), rank_pids(remote)
    assert len(servers) == 2 and len(ranks) == 4
    remote.teardown()
    assert wait_gone(servers + ranks) == []
    assert not state_file(name).exists()
    with pytest.raises(kt.NotDeployedError):
        remote()
    with pytest.raises(kt.NotDeployedError):
        remote.status()
    remote.teardown()  # a second teardown is harmless

    again = kt.fn(whoami, name=name).to(compute)
    try:
        results = again()
        assert [r["rank"] for r in results] == ["0", "1", "2", "3"]
        fresh = server_pids(name) + rank_pids(again)
        assert set(fresh).isdisjoint(servers + ranks)
    finally:
        again.teardown()


def test_other_handle_after_teardown_raises_not_deployed():
    """Two handles on one deployment (a re-run notebook cell). The older one is stale: the
    pods run the newer deploy's code, so calling through it raises NotDeployedError instead
    of running code it did not send. Tearing down through it makes calls through the newer
    one fail with NotDeployedError too, not a connection error."""
    name = unique("twohandles")
    first = kt.fn(whoami, name=name).to(kt.Compute(cpus=1))
    first_pid = first()["pid"]
    second = kt.fn(whoami, name=name).to(kt.Compute(cpus=1))
    try:
        assert second()["pid"] == first_pid  # the same pod and rank process, new code
        with pytest.raises(kt.NotDeployedError, match="redeployed since"):
            first()
        first.teardown()
        with pytest.raises(kt.NotDeployedError):
            second()
    finally:
        second.deployment.close()
        LocalBackend.shared().teardown(name, timeout=5)


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import ktlite as kt

    def hello():
        return os.getpid()

    name, how = sys.argv[1], sys.argv[2]
    remote = kt.fn(hello, name=name).to(kt.Compute(cpus=1).distribute("spmd", workers=2))
    assert len(remote()) == 2
    state = os.path.join(os.environ["KTLITE_HOME"], "local", name, "state.json")
    with open(state) as f:
        pids = [p["pid"] for p in json.load(f)["pods"]]
    pids += [r["pid"] for pod in remote.status() for r in pod["ranks"]]
    print("PIDS " + json.dumps(pids), flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit: the pods must notice on their own
""")


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_pods_do_not_outlive_their_creator(how):
    name = unique(f"child-{how}")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, name, how],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PIDS ")]
    assert lines, f"child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    pids = json.loads(lines[-1][5:])
    assert len(pids) == 4
    assert proc.returncode == (0 if how == "exit" else -signal.SIGKILL), proc.stderr
    left = wait_gone(pids, timeout=3.0)
    assert left == [], f"processes {left} outlived the Python process that created them"


# ---- 9. large arguments and results --------------------------------------------------------

MB100 = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def echo():
    remote = kt.fn(echo_with_digest, name=unique("echo")).to(kt.Compute(cpus=1, stream_logs=False))
    yield remote
    remote.teardown()


def test_numpy_100mb_argument_and_result(echo):
    arr = np.random.default_rng(7).standard_normal(MB100 // 8)
    meta, back = echo(arr)
    assert meta["digest"] == digest(arr), "the argument arrived changed"
    assert meta["type"] == "numpy.ndarray" and meta["shape"] == arr.shape
    assert isinstance(back, np.ndarray) and back.dtype == arr.dtype and back.shape == arr.shape
    assert np.array_equal(back, arr)
    assert back.flags.writeable
    del arr, back


@pytest.mark.parametrize("n", [100, 10_000, 300_000], ids=["in-band", "out-of-band-inline", "shm"])
def test_numpy_result_is_a_writable_exact_copy(echo, n):
    """Results of every size come back as ordinary arrays: equal, and writable in place."""
    arr = np.arange(n, dtype=np.float64)
    meta, back = echo(arr)
    assert meta["digest"] == digest(arr)
    assert np.array_equal(back, arr)
    assert back.flags.writeable, f"a {arr.nbytes}-byte result came back read-only"
    back += 1  # what users do with a result


def test_torch_100mb_argument_and_result(echo):
    import torch

    t = torch.randn(MB100 // 4, generator=torch.Generator().manual_seed(7))
    meta, back = echo(t)
    assert meta["digest"] == digest(t), "the argument arrived changed"
    assert meta["type"] == "torch.Tensor" and meta["dtype"] == "torch.float32"
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float32 and back.shape == t.shape
    assert torch.equal(back, t)
    del t, back


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_100mb_generated_on_the_pod(kind):
    remote = kt.fn(make_big, name=unique(f"big-{kind}")).to(kt.Compute(cpus=1, stream_logs=False))
    try:
        back = remote(kind, MB100, 11)
    finally:
        remote.teardown()
    expected = make_big(kind, MB100, 11)
    assert type(back) is type(expected)
    assert back.dtype == expected.dtype and tuple(back.shape) == tuple(expected.shape)
    assert digest(back) == digest(expected)


@pytest.mark.parametrize("shape", [(3, 5), (1000, 33)], ids=["inline", "out-of-band"])
def test_bf16_tensor_round_trip(echo, shape):
    import torch

    t = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    meta, back = echo(t)
    assert meta["dtype"] == "torch.bfloat16" and meta["digest"] == digest(t)
    assert back.dtype == torch.bfloat16 and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("make", ["leaf", "parameter"])
def test_requires_grad_tensor_round_trip(echo, make):
    import torch

    base = torch.randn(256, 64, generator=torch.Generator().manual_seed(5))
    t = (
        torch.nn.Parameter(base.clone())
        if make == "parameter"
        else base.clone().requires_grad_(True)
    )
    meta, back = echo(t)
    assert meta["requires_grad"] is True and meta["digest"] == digest(t)
    assert back.requires_grad
    assert type(back) is type(t)
    assert torch.equal(back.detach(), t.detach())
    back.sum().backward()  # still a usable leaf
    assert back.grad is not None and torch.equal(back.grad, torch.ones_like(base))


def _answer_one() -> int:
    return 1


def test_a_detached_local_deployment_stops_after_inactivity_ttl() -> None:
    remote = kt.fn(_answer_one, name="local-ttl").to(kt.Compute(inactivity_ttl=2), detached=True)
    assert remote() == 1
    pids = [pod["server_pid"] for pod in remote.status()]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.25)
    assert not any(alive(p) for p in pids), "the pod outlived its inactivity_ttl"
    remote.teardown()


def _sleep_then_one(seconds: float) -> int:
    time.sleep(seconds)  # the call's own work, longer than the idle time checked after it
    return 1


def test_idle_time_counts_from_the_end_of_the_last_call_not_its_start() -> None:
    """A call that ran for a while leaves its deployment just used, not idle for as long as
    the call took (else a long call ending past ``inactivity_ttl`` tore the deployment down
    right after it returned, found by the stand-in cluster's TTL test)."""
    seconds = 3.0 * time_scale()
    name = f"local-busy-{uuid.uuid4().hex[:6]}"
    remote = kt.fn(_sleep_then_one, name=name).to(kt.Compute(inactivity_ttl="1h"), detached=True)
    try:
        assert remote(seconds) == 1
        row = next(r for r in LocalBackend.shared().list() if r["name"] == name)
        assert row["idle_s"] < seconds, row
    finally:
        remote.teardown()


def test_list_shows_how_long_a_local_deployment_has_been_idle_and_its_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ktlite.commands import cli

    name = f"local-idle-{uuid.uuid4().hex[:6]}"
    remote = kt.fn(_answer_one, name=name).to(kt.Compute(inactivity_ttl="1h"), detached=True)
    try:
        assert remote() == 1
        row = next(r for r in LocalBackend.shared().list() if r["name"] == name)
        assert row["ttl_s"] == 3600 and 0 <= row["idle_s"] < 3600, row
        capsys.readouterr()
        assert cli.main(["list", "--backend", "local"]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(name))
        assert " in 59m" in line or " in 1h00m" in line, line
    finally:
        remote.teardown()
