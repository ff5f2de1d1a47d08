"""A torch deployment's ranks forked from a zygote that imported torch (``rankpreload``):
real zygotes and rank processes (``RankProcess`` handles, no HTTP), then real local pods.

What the zygote preloaded is proved from the rank: its parent (the zygote) has torch's
library mapped, and torch is in the rank's ``sys.modules`` before its code imported it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import ktlite as kt
from ktlite_server import rankpreload, rankzygote
from ktlite_server.ranks import RankProcess
from ktlite_wire import codec, rankchannel

pytestmark = pytest.mark.skipif(not rankzygote.available(), reason="needs os.fork and pidfds")
LONG = 60.0
PRELOAD = rankpreload.PRELOAD_VAR


@pytest.fixture(autouse=True)
def _fresh_zygote() -> None:
    rankzygote.reset()  # see tests/test_rank_zygote.py


def probe() -> dict[str, Any]:
    """In a rank: what it inherited (it imports nothing of torch before looking)."""
    had_torch = "torch" in sys.modules
    zygote = os.getppid()
    maps = Path(f"/proc/{zygote}/maps").read_text()
    out: dict[str, Any] = {
        "had_torch": had_torch,
        "zygote": zygote,
        "zygote_is_zygote": b"ktlite_server.rankzygote"
        in Path(f"/proc/{zygote}/cmdline").read_bytes(),
        "zygote_has_libtorch": "libtorch" in maps,
        "zygote_threads": len(os.listdir(f"/proc/{zygote}/task")),
    }
    if had_torch:
        torch = sys.modules["torch"]
        out.update(
            cuda_initialized=torch.cuda.is_initialized(),
            bad_fork=torch.cuda._is_in_bad_fork(),
            threads=torch.get_num_threads(),
            patched=getattr(sys.modules.get("torch.distributed"), "_ktlite_patched", False),
        )
    return out


def group_twice(port: int) -> tuple[Any, bool, Any, bool]:
    """A stateless function's ``init_process_group`` on every call: the patch keeps the group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    first = dist.init_process_group("gloo")
    second = dist.init_process_group("gloo")  # unpatched: "trying to initialize twice"
    destroyed = dist.destroy_process_group()  # deferred to the process's exit
    return first, dist.is_initialized(), (second, destroyed), dist._ktlite_patched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _run_in(rank: RankProcess, fn: Any, *args: Any, env: dict[str, str] | None = None) -> Any:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank can't import it
    try:
        bundle = cloudpickle.dumps(fn)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    loaded = await rank.load(rankchannel.Load(env=env or {}, bundle=bundle), LONG)
    assert loaded.ok, codec.loads(bytearray(loaded.error or b""))
    data = codec.dumps((None, args, {}))
    result = await asyncio.wait_for(rank.call(rankchannel.Call("c1", data, size=len(data))), LONG)
    value = codec.loads(bytearray(result.inline or b""))
    assert result.ok, value
    return value


def _in_a_rank(env: dict[str, str], fn: Any, *args: Any) -> tuple[Any, bool]:
    """``fn(*args)`` in a rank started with ``env``; and whether it was forked."""

    async def main() -> tuple[Any, bool]:
        rank = RankProcess(0, env, lambda *_: None)
        try:
            await rank.start(LONG)
            # the rank env's thread setting, as a deployment's Load brings it
            threads = {k: v for k, v in env.items() if k == "OMP_NUM_THREADS"}
            value = await _run_in(rank, fn, *args, env=threads)
            return value, isinstance(rank.proc, rankzygote.ForkedProcess)
        finally:
            rank.kill()
            await rank.wait_dead(LONG)
            rankzygote.reset()

    return asyncio.run(main())


def test_a_torch_deployments_rank_finds_torch_imported_by_its_zygote(torch) -> None:
    env = {**os.environ, PRELOAD: "torch", "OMP_NUM_THREADS": "1"}
    got, forked = _in_a_rank(env, probe)
    assert forked and got["zygote_is_zygote"], got
    assert got["had_torch"] and got["zygote_has_libtorch"], got
    # never CUDA in the zygote: a child of a process that initialised it could not use it
    assert got["cuda_initialized"] is False and got["bad_fork"] is False, got
    # torch.distributed came with `import torch`, in the zygote: patched there as in a rank
    assert got["patched"] is True, got
    # a library's thread count is fixed at import: the zygote imported with the rank's
    assert got["threads"] == 1, got
    # the one thread `import torch` starts (OpenBLAS's) is stopped around each fork
    assert got["zygote_threads"] == 1, got


def test_the_distributed_patch_works_in_a_rank_forked_after_the_preload(torch) -> None:
    env = {**os.environ, PRELOAD: "torch"}
    (first, initialized, kept, patched), forked = _in_a_rank(env, group_twice, _free_port())
    assert forked and patched is True
    assert first is None and initialized is True
    assert kept == (None, None)  # the second init returned the live group; destroy waited


def test_a_deployment_that_does_not_use_torch_has_a_zygote_without_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != PRELOAD}
    got, forked = _in_a_rank(env, probe)
    assert forked and got["zygote_is_zygote"], got
    assert not got["had_torch"] and not got["zygote_has_libtorch"], got


def test_a_failed_preload_is_logged_and_the_zygote_forks_without_it(capfd) -> None:
    env = {**os.environ, PRELOAD: "ktlite_no_such_module"}
    got, forked = _in_a_rank(env, probe)
    assert forked and got["zygote_is_zygote"] and not got["had_torch"], got
    err = capfd.readouterr().err
    assert "could not preload ktlite_no_such_module (ModuleNotFoundError" in err, err


def test_which_deployments_preload_torch() -> None:
    base = {"PATH": "/bin"}
    rank_env = {"RANK": "1", "OMP_NUM_THREADS": "2", "KTLITE_FRAMEWORK": "pytorch"}
    torch = rankpreload.installed("torch")
    started = rankpreload.start_env(base, rank_env, uses_torch=True)
    if torch:
        assert started == {"PATH": "/bin", PRELOAD: "torch", "OMP_NUM_THREADS": "2"}
    else:
        assert started == base  # nothing to preload: the pod's own zygote serves
    assert rankpreload.start_env(base, rank_env, uses_torch=False) == base
    # the pod's own setting wins: "" never preloads, a list always does
    assert rankpreload.start_env({**base, PRELOAD: ""}, rank_env, True) == {**base, PRELOAD: ""}
    assert rankpreload.start_env({**base, PRELOAD: "numpy"}, {}, False)[PRELOAD] == "numpy"
    # the ranks started before the code arrives preload nothing: no thread settings yet
    assert rankpreload.start_env({**base, PRELOAD: "torch"}, None, True) == base


# ---- local pods: the pod server decides -----------------------------------------------


def act(mode: str | dict[int, str], port: int = 0) -> Any:
    """``mode``, or per rank ``{rank: mode}``."""
    if isinstance(mode, dict):
        mode = mode[int(os.environ["RANK"])]
    if mode == "die":
        time.sleep(0.5)  # the other ranks' calls end first: they stay alive
        os._exit(3)
    if mode == "torch":
        import torch  # noqa: F401 - inside the function: the pod cannot know from the code

        return None
    if mode == "group":
        return group_twice(port)[0]
    return probe()


def test_a_rank_replaced_beside_one_that_imported_torch_is_forked_with_torch(torch) -> None:
    remote = kt.fn(act, name="pre-pt").to(
        kt.Compute(cpus=1).distribute("pytorch", workers=1, num_proc=2)
    )
    try:
        first = remote("probe")
        # the first ranks were started before the code arrived; nothing used torch yet
        assert all(r["zygote_is_zygote"] and not r["zygote_has_libtorch"] for r in first), first
        assert not any(r["had_torch"] for r in first), first
        assert remote("torch") == [None, None]  # both ranks import it, in the call
        with pytest.raises(kt.RemoteError):
            remote({0: "die", 1: "torch"})  # rank 1 is alive, with torch, when 0 is replaced
        again = remote("probe")
        assert again[1]["zygote"] == first[1]["zygote"], again  # rank 1 kept its process
        new = again[0]
        assert new["zygote"] != first[0]["zygote"] and new["zygote_is_zygote"], new
        assert new["had_torch"] and new["zygote_has_libtorch"] and new["patched"], new
        assert new["cuda_initialized"] is False, new
    finally:
        remote.teardown()


def test_an_spmd_deployment_preloads_torch_once_a_rank_held_a_group(torch) -> None:
    remote = kt.fn(act, name="pre-spmd").to(
        kt.Compute(cpus=1).distribute("spmd", workers=1, num_proc=1)
    )
    try:
        with pytest.raises(kt.RemoteError):
            remote("die")
        plain = remote("probe")[0]  # restarted: nothing told the pod its ranks use torch
        assert plain["zygote_is_zygote"] and not plain["zygote_has_libtorch"], plain
        assert not plain["had_torch"], plain
        assert remote("group", _free_port()) == [None]
        with pytest.raises(kt.RemoteError):
            remote("die")  # it held a group: its successor is forked with torch
        learned = remote("probe")[0]
        assert learned["had_torch"] and learned["zygote_has_libtorch"], learned
    finally:
        remote.teardown()


def test_a_slow_preload_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote's first fork follows its preload, which may take longer than a fork is given
    (torch from a cold disk): it is waited for, not taken for a hung zygote."""
    (tmp_path / "ktlite_slow_mod.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.setattr(rankzygote, "SPAWN_TIMEOUT_S", 0.5)
    env = {**os.environ, PRELOAD: "ktlite_slow_mod", "PYTHONPATH": str(tmp_path)}
    got, forked = _in_a_rank(env, lambda: "ktlite_slow_mod" in sys.modules)
    assert forked and got is True


def test_a_zygote_whose_ranks_moved_to_another_environments_is_stopped() -> None:
    """The pod's plain zygote, once its last rank is gone and a preloading one was asked for
    since, is stopped: its pages are shared with no rank any more."""

    async def main() -> tuple[bool, bool, bool]:
        plain = RankProcess(0, dict(os.environ), lambda *_: None)
        loaded = RankProcess(1, {**os.environ, PRELOAD: "json"}, lambda *_: None)
        try:
            await plain.start(LONG)
            await loaded.start(LONG)
            first, second = rankzygote._state["zygotes"]
            plain.kill()
            await plain.wait_dead(LONG)
            return first.closed, second.closed, first.proc.poll() is not None
        finally:
            for r in (plain, loaded):
                r.kill()
                await r.wait_dead(LONG)
            rankzygote.reset()

    first_closed, second_closed, first_exited = asyncio.run(main())
    assert first_closed and first_exited and not second_closed
