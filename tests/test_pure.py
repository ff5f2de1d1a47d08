"""Pure tests: no pod or rank process is started here.

Covers the distributed-env contract, ``kt.Compute`` validation, the wire protocol
(out-of-band buffers, truncation, frame reassembly), the public export list, import
weight, and dryrun plans.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ktlite
import ktlite as kt
from ktlite.specs.quantities import parse_memory
from ktlite.specs.spec import DistributedConfig, distributed_env
from ktlite_wire import codec, envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.frames import (
    ERROR,
    FRAME,
    HEARTBEAT,
    LOG,
    RESULT,
    FrameParser,
    frame,
    frame_item,
    read_frames,
)
from ktlite_wire.version import PROTOCOL_VERSION

IPS = ["10.0.0.1", "10.0.0.2"]
PORT = 29555


def _all_envs(
    framework: str,
    workers: int = 2,
    num_proc: int = 2,
    ips: list[str] | None = None,
    cpus: float | None = 8,
) -> list[dict[str, str]]:
    cfg = DistributedConfig(framework=framework, workers=workers, num_proc=num_proc)
    ips = (
        ips
        if ips is not None
        else IPS[:workers] + [f"10.0.1.{i}" for i in range(max(0, workers - 2))]
    )
    return [
        distributed_env(
            cfg,
            node_rank=n,
            local_rank=lr,
            pod_ips=ips,
            master_port=PORT,
            run_id="run-xyz",
            cpus_per_pod=cpus,
        )
        for n in range(workers)
        for lr in range(num_proc)
    ]


# ---- distributed_env -------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["spmd", "pytorch", "jax", "tensorflow"])
def test_distributed_env_common_values(framework: str) -> None:
    envs = _all_envs(framework)
    assert len(envs) == 4
    for i, env in enumerate(envs):
        node, local = divmod(i, 2)
        assert env["RANK"] == str(node * 2 + local) == str(i)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(local)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == str(node)
        assert env["GROUP_RANK"] == str(node)
        assert env["MASTER_ADDR"] == IPS[0]
        assert env["MASTER_PORT"] == str(PORT)
        assert env["POD_IPS"] == ",".join(IPS)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]


@pytest.mark.parametrize("framework", ["spmd", "pytorch", "jax", "tensorflow"])
def test_distributed_env_is_stable(framework: str) -> None:
    # the same inputs always give the same env (ranks never reshuffle between calls)
    assert _all_envs(framework) == _all_envs(framework)
    cfg = DistributedConfig(framework=framework, workers=3, num_proc=4)
    ips = ["a", "b", "c"]
    for node, local in itertools.product(range(3), range(4)):
        env = distributed_env(cfg, node_rank=node, local_rank=local, pod_ips=ips, master_port=1)
        assert env["RANK"] == str(node * 4 + local)
        assert env["WORLD_SIZE"] == "12"
        assert env["MASTER_ADDR"] == "a"


def test_distributed_env_framework_specifics() -> None:
    spmd = _all_envs("spmd")
    for env in spmd:
        assert not any(k.startswith(("JAX_", "TORCHELASTIC")) for k in env)
        assert "TF_CONFIG" not in env

    for env in _all_envs("pytorch"):
        assert env["TORCHELASTIC_RUN_ID"] == "run-xyz"
        assert "TF_CONFIG" not in env and "JAX_PROCESS_ID" not in env

    for env in _all_envs("jax"):
        assert env["JAX_COORDINATOR_ADDRESS"] == f"{IPS[0]}:{PORT}"
        assert env["JAX_NUM_PROCESSES"] == "4"
        assert env["JAX_PROCESS_ID"] == env["RANK"]
        assert "TF_CONFIG" not in env


@pytest.mark.parametrize(
    "ips", [IPS, ["127.0.0.1", "127.0.0.1"]], ids=["distinct-hosts", "one-host"]
)
def test_distributed_env_tf_config(ips: list[str]) -> None:
    envs = _all_envs("tensorflow", ips=ips)
    configs = [json.loads(e["TF_CONFIG"]) for e in envs]
    cluster = configs[0]["cluster"]["worker"]
    assert len(cluster) == 4
    assert len(set(cluster)) == 4, f"TF worker addresses must be unique: {cluster}"
    ports = [int(a.rsplit(":", 1)[1]) for a in cluster]
    if len(set(ips)) == 1:
        assert len(set(ports)) == 4, "ranks sharing a host need distinct ports"
    for r, cfg in enumerate(configs):
        assert cfg["cluster"]["worker"] == cluster  # every rank sees the same cluster
        assert cfg["task"] == {"type": "worker", "index": r}
        host = cluster[r].rsplit(":", 1)[0]
        assert host == ips[r // 2]  # rank r's address is on its own pod


def test_distributed_env_omp_threads() -> None:
    # P > 1: cpus // P, at least 1
    assert {e["OMP_NUM_THREADS"] for e in _all_envs("spmd", num_proc=2, cpus=8)} == {"4"}
    assert {e["OMP_NUM_THREADS"] for e in _all_envs("spmd", num_proc=4, cpus=2)} == {"1"}
    assert {e["OMP_NUM_THREADS"] for e in _all_envs("pytorch", num_proc=2, cpus=None)} == {"1"}
    assert {e["OMP_NUM_THREADS"] for e in _all_envs("spmd", num_proc=3, cpus=7.5)} == {"2"}
    # P == 1: left alone
    for env in _all_envs("spmd", num_proc=1, cpus=8):
        assert "OMP_NUM_THREADS" not in env


def test_distributed_env_rejects_wrong_pod_count() -> None:
    cfg = DistributedConfig(workers=2)
    with pytest.raises(ValueError, match="2 workers"):
        distributed_env(cfg, node_rank=0, local_rank=0, pod_ips=["only-one"], master_port=1)


# ---- kt.Compute validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "memory, quantity, size",
    [
        ("4Gb", "4G", 4 * 10**9),
        ("4GB", "4G", 4 * 10**9),
        ("512mb", "512M", 512 * 10**6),
        ("2gb", "2G", 2 * 10**9),
        ("8 GB", "8G", 8 * 10**9),
        ("16KB", "16k", 16000),
        ("1.5GiB", "1.5Gi", 3 * 2**29),
        ("512MiB", "512Mi", 512 * 2**20),
        ("4gi", "4Gi", 4 * 2**30),
        ("100B", "100", 100),
        (10**9, "1000000000", 10**9),
    ],
)
def test_memory_in_the_units_nemo_and_ray_users_write(memory, quantity: str, size: int) -> None:
    """Issue 23: NeMo RL's memory_limit="8GB" was refused with "did you mean 8Gi?". Decimal
    units are powers of ten (GB = 10^9, as in Kubernetes' G), binary ones powers of two, and
    the Compute keeps the Kubernetes spelling its manifests carry."""
    assert kt.Compute(memory=memory).memory == quantity
    assert parse_memory(memory) == size == parse_memory(quantity)
    assert kt.Compute(shared_memory=memory, memory_limit=memory).memory_limit == quantity
    assert kt.Volume("data", size=memory).size == quantity


@pytest.mark.parametrize(
    "memory, words",
    [
        ("512m", ["memory='512m'", "milli", "512Mi"]),
        ("lots", ["memory='lots'", "'4Gi'", "'4GB'"]),
        ("4 gigs", ["memory='4 gigs'"]),
        ("-1Gi", ["memory='-1Gi'"]),
        (True, ["memory=True"]),
    ],
)
def test_memory_that_is_no_size_is_refused(memory, words: list[str]) -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.Compute(memory=memory)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("memory", ["512Mi", "4Gi", "1Ti", "2G", "1000"])
def test_memory_valid(memory: str) -> None:
    assert kt.Compute(memory=memory).memory == memory


@pytest.mark.parametrize("cpus", ["abc", "-1", 0, -2, True, "1.5x"])
def test_cpus_invalid(cpus: object) -> None:
    with pytest.raises(kt.ConfigError, match="cpus"):
        kt.Compute(cpus=cpus)


@pytest.mark.parametrize("cpus, count", [(2, 2.0), (0.5, 0.5), ("500m", 0.5), ("3", 3.0)])
def test_cpus_valid(cpus: object, count: float) -> None:
    assert kt.Compute(cpus=cpus).cpu_count == count


@pytest.mark.parametrize("gpus", [-1, 1.5, "two", "1.5", True])  # "2" is Kubetorch's form of 2
def test_gpus_invalid(gpus: object) -> None:
    with pytest.raises(kt.ConfigError, match="gpus"):
        kt.Compute(gpus=gpus)


@pytest.mark.parametrize("workers", [0, -1, 1.0, "2", True])
def test_workers_invalid(workers: object) -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.Compute(cpus=1).distribute("pytorch", workers=workers)
    assert "workers" in str(info.value)


def test_num_proc_invalid() -> None:
    with pytest.raises(kt.ConfigError, match="num_proc"):
        kt.Compute().distribute("spmd", workers=1, num_proc=0)


@pytest.mark.parametrize("framework", ["torch", "PyTorch", "mpi", "Ray", "Monarch", ""])
def test_unknown_framework(framework: str) -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.Compute().distribute(framework, workers=2)
    assert repr(framework) in str(info.value)


def test_known_frameworks_accepted() -> None:
    for fw in ("spmd", "pytorch", "jax", "tensorflow"):
        c = kt.Compute(cpus=2).distribute(fw, workers=3, num_proc=2)
        assert c.distributed.framework == fw
        assert c.distributed.world_size == 6


def test_distribute_changes_the_compute_it_is_called_on() -> None:
    # Kubetorch's meaning: `compute.distribute(...)` alone distributes `compute`; a deployment
    # keeps its own copy (tests/test_kubetorch_compat.py)
    base = kt.Compute(cpus=1)
    dist = base.distribute("pytorch", workers=2)
    assert dist is base and base.distributed.workers == 2
    with pytest.raises(kt.ConfigError, match="unknown option"):
        base.distribute("pytorch", workers=2, nprocs=2)
    assert base.distributed.workers == 2  # a refused distribute() changes nothing


@pytest.mark.parametrize("key", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"])
def test_env_clash_with_rank_vars(key: str) -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.Compute(env={key: "3", "OTHER": "x"})
    assert key in str(info.value)
    with pytest.raises(kt.ConfigError, match=key):
        kt.Compute(env_vars={key: "3"})


def test_env_values_must_be_strings() -> None:
    with pytest.raises(kt.ConfigError, match="env"):
        kt.Compute(env={"A": 1})


def test_num_proc_more_than_gpus() -> None:
    with pytest.raises(kt.ConfigError) as info:
        kt.Compute(gpus=2).distribute("pytorch", workers=2, num_proc=4)
    assert "num_proc" in str(info.value) and "gpus" in str(info.value)
    # num_proc defaults to the GPU count; fewer procs than GPUs is fine
    assert kt.Compute(gpus=2).distribute("pytorch", workers=2).distributed.num_proc == 2
    assert kt.Compute(gpus=2).distribute("pytorch", workers=2, num_proc=1).distributed.num_proc == 1
    # CPU pods may have any number of procs
    assert kt.Compute().distribute("spmd", num_proc=4).distributed.num_proc == 4


def test_env_vars_alias() -> None:
    c = kt.Compute(env_vars={"A": "1", "B": "2"})
    assert c.env == {"A": "1", "B": "2"}
    assert c.env_vars is None
    assert c == kt.Compute(env={"A": "1", "B": "2"})
    with pytest.raises(kt.ConfigError, match="env_vars"):
        kt.Compute(env={"A": "1"}, env_vars={"B": "2"})


def test_compute_is_frozen() -> None:
    c = kt.Compute(cpus=1)
    with pytest.raises(AttributeError):
        c.cpus = 2  # type: ignore[misc]


# ---- protocol --------------------------------------------------------------------------------


def _base_addr(buf: bytearray) -> tuple[int, int]:
    a = np.frombuffer(buf, dtype=np.uint8)
    return a.ctypes.data, a.ctypes.data + a.nbytes


def test_protocol_round_trip_plain_objects() -> None:
    obj = {
        "a": [1, 2.5, "x", None, True],
        "b": (b"bytes", bytearray(b"ba")),
        "c": {1, 2},
        "nested": {"deep": [{"k": "v"}] * 3},
        "big": b"z" * 10_000,
    }
    for data in (codec.dumps(obj), bytearray(codec.dumps(obj))):
        assert codec.loads(data) == obj
    # parts and joined bytes agree
    parts = codec.dumps_parts(obj)
    assert b"".join(bytes(memoryview(p)) for p in parts) == codec.dumps(obj)
    assert envelope.parts_size(parts) == len(codec.dumps(obj))


def test_protocol_large_bytes_are_parts_not_copies() -> None:
    # pickle writes a bytes value in band; the message keeps the object itself as a part
    big = bytes(range(256)) * 4096
    other = bytes(70_000)
    obj = {"big": big, "small": b"s" * 100, "tail": [other, "x" * 70_000, big]}
    parts = codec.dumps_parts(obj)
    assert (
        sum(p is big for p in parts) == 1 and sum(p is other for p in parts) == 1
    )  # the 2nd big: memo
    data = b"".join(bytes(memoryview(p)) for p in parts)
    assert envelope.parts_size(parts) == len(data)
    assert codec.loads(data) == obj and codec.loads(bytearray(data)) == obj


def test_protocol_round_trip_function() -> None:
    def local_fn(x: int) -> int:
        return x * 7

    assert codec.loads(codec.dumps(local_fn))(6) == 42


def test_protocol_numpy_out_of_band_zero_copy() -> None:
    a = np.arange(100_000, dtype=np.float64)
    b = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    small = np.arange(10, dtype=np.int32)  # stays in band
    data = bytearray(codec.dumps({"a": a, "b": b, "small": small}))
    out = codec.loads(data)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    np.testing.assert_array_equal(out["small"], small)
    assert out["a"].dtype == np.float64 and out["b"].shape == (64, 64)
    backing = np.frombuffer(data, dtype=np.uint8)
    assert np.shares_memory(out["a"], backing)
    assert np.shares_memory(out["b"], backing)
    assert not np.shares_memory(out["small"], backing)
    # decoding from a writable buffer gives writable arrays; writes land in the buffer
    assert out["a"].flags.writeable
    out["a"][0] = -1.0
    assert codec.loads(data)["a"][0] == -1.0
    # out-of-band buffers start on 64-byte boundaries of the message
    start, _ = _base_addr(data)
    assert (out["a"].ctypes.data - start) % 64 == 0
    assert (out["b"].ctypes.data - start) % 64 == 0
    # no base64 or copies: the message is barely larger than the raw data
    assert len(data) < a.nbytes + b.nbytes + 2048


def test_protocol_numpy_memoryview_input_shares_memory() -> None:
    a = np.arange(5000, dtype=np.int64)
    data = bytearray(codec.dumps(a))
    out = codec.loads(memoryview(data))
    assert np.shares_memory(out, np.frombuffer(data, dtype=np.uint8))


def _inside(t: object, buf: bytearray) -> bool:
    lo, hi = _base_addr(buf)
    return lo <= t.data_ptr() < hi  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "uint8", "bool"])
def test_protocol_torch_tensor_out_of_band(dtype: str, torch) -> None:
    tdtype = getattr(torch, dtype)
    t = (torch.arange(8192) % 7).to(tdtype).reshape(64, 128)
    data = bytearray(codec.dumps({"t": t}))
    out = codec.loads(data)["t"]
    assert type(out) is torch.Tensor
    assert out.dtype == tdtype and out.shape == t.shape
    assert torch.equal(out, t)
    assert _inside(out, data), "tensor should be a view of the received buffer"
    assert len(data) < t.numel() * t.element_size() + 2048


def test_protocol_torch_bf16_values_exact(torch) -> None:
    t = torch.randn(3000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    data = bytearray(codec.dumps(t))
    out = codec.loads(data)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    assert _inside(out, data)


def test_protocol_torch_parameter_and_requires_grad(torch) -> None:
    p = torch.nn.Parameter(torch.randn(4096))
    frozen = torch.nn.Parameter(torch.randn(4096), requires_grad=False)
    leaf = torch.randn(2048, 2, requires_grad=True)
    plain = torch.randn(2048, 2)
    data = bytearray(codec.dumps({"p": p, "frozen": frozen, "leaf": leaf, "plain": plain}))
    out = codec.loads(data)
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert isinstance(out["frozen"], torch.nn.Parameter) and not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert not out["plain"].requires_grad
    for k, orig in {"p": p, "frozen": frozen, "leaf": leaf, "plain": plain}.items():
        assert torch.equal(out[k].detach(), orig.detach()), k
        assert _inside(out[k], data), k
    # gradients still flow through a received parameter
    (out["p"] * 2).sum().backward()
    assert torch.equal(out["p"].grad, torch.full((4096,), 2.0))


def test_protocol_torch_noncontiguous_and_empty(torch) -> None:
    t = torch.arange(20000, dtype=torch.float32).reshape(100, 200).t()
    e = torch.empty(0, 3)
    out = codec.loads(bytearray(codec.dumps([t, e])))
    assert torch.equal(out[0], t) and out[0].shape == (200, 100)
    assert out[1].shape == (0, 3) and out[1].dtype == torch.float32


def _sample_message() -> bytes:
    return codec.dumps(
        {
            "a": np.arange(1500, dtype=np.float32),  # 6000 bytes: out of band
            "b": np.ones(2100, dtype=np.int16),  # 4200 bytes: out of band
            "meta": "x" * 50,
        }
    )


def test_protocol_truncated_messages_raise_protocol_error() -> None:
    data = _sample_message()
    _, _, nbufs, _ = envelope.HEAD.unpack_from(data)
    assert nbufs == 2  # the sample really has out-of-band buffers
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            codec.loads(bytearray(data[:cut]))
    assert codec.loads(data)["meta"] == "x" * 50


def test_protocol_truncated_in_band_message() -> None:
    data = codec.dumps({"k": list(range(100))})
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            codec.loads(data[:cut])


def test_protocol_bad_magic_and_version() -> None:
    data = bytearray(codec.dumps([1, 2, 3]))
    bad = bytearray(data)
    bad[0:3] = b"XYZ"
    with pytest.raises(ProtocolError, match="magic"):
        codec.loads(bad)
    bad = bytearray(data)
    bad[3] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match="version"):
        codec.loads(bad)
    with pytest.raises(ProtocolError):
        codec.loads(b"")
    assert issubclass(ProtocolError, ValueError)


# ---- frames ----------------------------------------------------------------------------------


def _frames() -> list[tuple[int, bytes]]:
    result = b"".join(bytes(memoryview(p)) for p in codec.dumps_parts({"x": np.arange(3000)}))
    return [
        (HEARTBEAT, b""),
        (LOG, json.dumps([0, "pod-0", "out", "hello"]).encode()),
        (HEARTBEAT, b""),
        (LOG, json.dumps([3, "pod-1", "err", "ünïcode ✓"]).encode()),
        (RESULT, result),
        (ERROR, json.dumps({"type": "X", "message": "y"}).encode()),
        (HEARTBEAT, b""),
    ]


def _stream(frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(frame(k, p) for k, p in frames)


def test_frame_parser_byte_by_byte() -> None:
    frames = _frames()
    stream = _stream(frames)
    parser = FrameParser()
    got: list[tuple[int, bytearray]] = []
    for i in range(len(stream)):
        got.extend(parser.feed(stream[i : i + 1]))
    assert [(k, bytes(p)) for k, p in got] == frames
    assert all(isinstance(p, bytearray) for _, p in got)
    assert not parser.mid_frame
    # the result frame's payload decodes to a writable, zero-copy array
    payload = got[4][1]
    arr = codec.loads(payload)["x"]
    assert np.shares_memory(arr, np.frombuffer(payload, dtype=np.uint8))


def test_frame_parser_random_chunks_and_one_chunk() -> None:
    frames = _frames()
    stream = _stream(frames)
    rng = random.Random(7)
    for _ in range(50):
        parser = FrameParser()
        got, pos = [], 0
        while pos < len(stream):
            n = rng.randint(1, 300)
            got.extend(parser.feed(memoryview(stream)[pos : pos + n]))
            pos += n
        assert [(k, bytes(p)) for k, p in got] == frames
    parser = FrameParser()
    assert [(k, bytes(p)) for k, p in parser.feed(stream)] == frames


@pytest.mark.parametrize("n", [5000, 300_000])  # joined (small) and in parts (large)
def test_frame_item_matches_frame(n: int) -> None:
    parts = codec.dumps_parts({"x": np.arange(n)})
    item = frame_item(RESULT, parts)
    assert isinstance(item, bytes) == (n == 5000)
    joined = item if isinstance(item, bytes) else b"".join(bytes(memoryview(p)) for p in item)
    assert joined == frame(RESULT, b"".join(bytes(memoryview(p)) for p in parts))


def test_read_frames_mid_frame_raises() -> None:
    stream = _stream(_frames())
    assert len(list(read_frames([stream]))) == len(_frames())
    for cut in (1, FRAME.size + 3, len(stream) - 1):
        with pytest.raises(ProtocolError):
            list(read_frames([stream[:cut]]))


# ---- exports and import weight ---------------------------------------------------------------


def test_all_is_sorted_and_unique() -> None:
    assert ktlite.__all__ == sorted(ktlite.__all__)
    assert len(set(ktlite.__all__)) == len(ktlite.__all__)


def test_all_names_importable() -> None:
    for name in ktlite.__all__:
        assert hasattr(ktlite, name), name
        ns: dict[str, object] = {}
        exec(f"from ktlite import {name}", ns)
        assert ns[name] is getattr(ktlite, name)


def test_public_members_are_exported() -> None:
    import types

    # every public object ktlite itself defines is exported (typing helpers are not ktlite's)
    public = {
        n
        for n in dir(ktlite)
        if not n.startswith("_")
        and not isinstance(getattr(ktlite, n), types.ModuleType)
        and str(getattr(getattr(ktlite, n), "__module__", "")).startswith("ktlite")
    }
    assert public <= set(ktlite.__all__), (
        f"public but not in __all__: {sorted(public - set(ktlite.__all__))}"
    )


def test_error_hierarchy() -> None:
    assert issubclass(kt.ConfigError, ValueError) and issubclass(kt.ConfigError, kt.KtliteError)
    assert issubclass(kt.SerializationError, kt.ConfigError)
    assert issubclass(kt.SerializationError, TypeError)
    for cls in (kt.RemoteException, kt.RankDied, kt.CallTimeout, kt.CallCancelled):
        assert issubclass(cls, kt.RemoteError)
    assert issubclass(kt.CallTimeout, TimeoutError)
    assert issubclass(kt.LaunchTimeout, kt.DeployError) and issubclass(
        kt.LaunchTimeout, TimeoutError
    )


def test_import_is_light() -> None:
    code = (
        "import sys, ktlite; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kubernetes', 'numpy')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    heavy = [m for m in eval(out.stdout.strip()) if m.split(".")[0] in ("torch", "kubernetes")]
    assert heavy == [], f"`import ktlite` imported {heavy}"


# ---- dryrun ----------------------------------------------------------------------------------


def _dry_target(x: int) -> int:
    return x + 1


def _pod_processes(name: str) -> list[int]:
    """pids of this process's ktlite_server processes of ``name`` (ready file in KTLITE_HOME)."""
    found, ours = [], str(_local_dir(name)).encode() + b"/"  # other test runs use the names
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ktlite_server" in argv and any(a.startswith(ours) for a in argv):
            found.append(int(proc.name))
    return found


def _local_dir(name: str) -> Path:
    return Path(os.environ["KTLITE_HOME"]) / "local" / name


@pytest.mark.parametrize("distributed", [False, True])
def test_dryrun_returns_plan_and_starts_nothing(distributed: bool) -> None:
    name = "pure-dryrun-dist" if distributed else "pure-dryrun"
    secret = "s3cr3t-value-in-env"
    compute = kt.Compute(cpus=1, env={"API_KEY": secret})
    if distributed:
        compute = compute.distribute("pytorch", workers=3, num_proc=2)
    plan = kt.fn(_dry_target).to(compute, name=name, dryrun=True)
    assert isinstance(plan, kt.Plan)
    assert plan.backend == "local" and plan.name == name
    assert len(plan.commands) == (3 if distributed else 1)
    text = str(plan)
    assert name in text
    assert "ktlite_server" in text
    assert "echo <token> | " in text and "--token-stdin" in text  # never the token itself
    assert secret not in text, "env values must not be printed in a plan"
    assert not _local_dir(name).exists()
    assert _pod_processes(name) == []


def test_dryrun_default_name_and_cls() -> None:
    class My_Model:
        def __init__(self, lr: float) -> None:
            self.lr = lr

    plan = kt.fn(_dry_target).to(kt.Compute(), dryrun=True)
    assert plan.name == "dry-target"
    plan = kt.cls(My_Model).to(kt.Compute(), init_args={"lr": 0.1}, dryrun=True)
    assert isinstance(plan, kt.Plan) and plan.name == "my-model"
    assert not _local_dir("my-model").exists()


def test_dryrun_still_validates() -> None:
    import threading

    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(kt.SerializationError, match="lock"):
        kt.fn(uses_lock).to(kt.Compute(), dryrun=True)
    with pytest.raises(kt.ConfigError):
        kt.fn(_dry_target).to("not a compute", dryrun=True)  # type: ignore[arg-type]


def test_pickle_of_config_error_round_trips() -> None:
    # errors raised client-side can travel (e.g. through multiprocessing) intact
    err = pickle.loads(pickle.dumps(kt.ConfigError("workers=0 is out of range")))
    assert isinstance(err, kt.ConfigError) and "workers" in str(err)


def test_a_pod_with_another_python_minor_is_refused_with_the_fix() -> None:
    from ktlite.modes.callpath import check_python as _check_python

    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    _check_python({"python": f"{ours}.99", "pod": "p-0"}, "http://x")
    _check_python({"pod": "p-0"}, "http://x")  # an older server that does not say
    with pytest.raises(kt.ProtocolMismatch) as info:
        _check_python({"python": "2.7.18", "pod": "p-0"}, "http://x")
    assert "Python 2.7.18" in str(info.value) and f"kt.images.python('{ours}')" in str(info.value)
