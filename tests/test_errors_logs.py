"""Remote errors, rank deaths, timeouts, log streaming and call options, with real processes.

One 2 pods × 2 procs deployment (``el-job``) is shared by most tests; ``job(mode)`` picks
the behaviour. Every failure test checks that the next call on the same deployment works.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.backends.local_pods import visible_gpus

NAME = "el-job"
_LOCK = threading.Lock()  # a global that cannot be pickled


class BadExc(Exception):
    """Cannot be rebuilt by unpickling: ``args`` holds one value, ``__init__`` needs two."""

    def __init__(self, a: str, b: int) -> None:
        super().__init__(a)
        self.b = b


class CustomError(Exception):
    pass


def job(mode: str, arg: object = None, extra: object = None) -> object:
    rank = int(os.environ["RANK"])
    if mode == "rank":
        return rank
    if mode == "fail1":  # rank 1 fails after the others have finished
        if rank == 1:
            time.sleep(1.0)
            print("rank 1 is about to fail", flush=True)
            raise ValueError("boom from rank 1")
        return rank * 10
    if mode == "fail1_blocked":  # the others are blocked when rank 1 fails
        if rank == 1:
            time.sleep(0.3 if extra is None else float(extra))  # type: ignore[arg-type]
            raise ValueError("rank 1 gave up")
        time.sleep(float(arg or 60))  # type: ignore[arg-type]
        return rank
    if mode == "die_later":  # rank 2's process exits shortly after this call returned
        if rank == 2:
            threading.Thread(target=lambda: (time.sleep(0.2), os._exit(1)), daemon=True).start()
        return rank
    if mode == "bad_exc":
        if rank == 1:
            time.sleep(1.0)
            raise BadExc("cannot rebuild me", 2)
        return rank
    if mode == "custom":
        if rank == 1:
            raise CustomError("custom failure")
        return rank
    if mode == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(rank)])
        if rank == 1 and arg == "fail":
            raise RuntimeError("rank 1 skips the all_reduce")
        dist.all_reduce(t)
        return t.item()
    if mode == "exit3":
        if rank == 1:
            time.sleep(0.3)
            os._exit(3)
        time.sleep(60)
        return rank
    if mode == "print":
        print(f"out-line rank={rank}")
        print(f"err-line rank={rank}", file=sys.stderr)
        print(f"second out-line rank={rank}", flush=True)
        return rank
    if mode == "sleep":
        time.sleep(float(arg))  # type: ignore[arg-type]
        return rank
    if mode == "touch":
        Path(str(arg)).write_text(str(rank))
        return rank
    raise AssertionError(f"unknown mode {mode}")


def takes_opts(
    x: int,
    stream_logs: object = "default",
    workers: object = "default",
    restart_procs: object = "default",
) -> tuple[object, ...]:
    print(f"takes_opts ran with x={x}")
    return (x, stream_logs, workers, restart_procs)


def takes_kwargs(x: int, **kw: object) -> dict[str, object]:
    print(f"takes_kwargs ran with x={x}")
    return {"x": x, **kw}


def uses_lock() -> bool:
    return _LOCK.locked()


def _server_children() -> set[int]:
    """ktlite_server processes this test process started."""
    me = os.getpid()
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"ktlite_server" in argv:
            out.add(int(proc.name))
    return out


def _local_dir(name: str) -> Path:
    return Path(os.environ["KTLITE_HOME"]) / "local" / name


def _log_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("[rank ")]


@pytest.fixture(scope="module")
def dist():
    remote = kt.fn(job, name=NAME).to(kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=2))
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def quiet():
    remote = kt.fn(takes_opts, name="el-quiet").to(kt.Compute(cpus=1, stream_logs=False))
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def kwdep():
    remote = kt.fn(takes_kwargs, name="el-kwargs").to(kt.Compute(cpus=1))
    yield remote
    remote.teardown()


def _works(remote) -> None:
    assert remote.options(stream_logs=False)("rank") == [0, 1, 2, 3]


# ---- 5. errors -------------------------------------------------------------------------------


def test_baseline(dist) -> None:
    assert dist("rank") == [0, 1, 2, 3]


def test_value_error_on_rank_1_keeps_type(dist) -> None:
    with pytest.raises(ValueError, match="boom from rank 1") as info:
        dist("fail1")
    err = info.value
    assert isinstance(err, kt.RemoteError)
    assert type(err).__name__ == "ValueError"
    context = str(err) + "\n" + "\n".join(getattr(err, "__notes__", []))
    assert "rank 1" in context
    assert f"{NAME}-0" in context  # rank 1 lives on pod 0
    assert "Traceback" in context and 'raise ValueError("boom from rank 1")' in context
    assert "in job" in context
    assert [f.rank for f in err.failures] == [1]
    failure = err.failures[0]
    assert failure.pod == f"{NAME}-0" and failure.kind == "error"
    assert "raise ValueError" in failure.traceback
    assert isinstance(failure.exception, ValueError)
    # the other ranks returned before rank 1 failed: their values travel on the error
    assert err.results == {0: 0, 2: 20, 3: 30}
    assert err.outcomes[0] == 0 and isinstance(err.outcomes[1], ValueError)
    _works(dist)


def test_value_error_caught_as_remote_error(dist) -> None:
    try:
        dist("fail1")
    except kt.RemoteError as err:
        assert isinstance(err, ValueError)
        assert err.failed_ranks == [1]
    else:
        pytest.fail("no error raised")
    _works(dist)


def test_custom_picklable_exception_keeps_its_class(dist) -> None:
    with pytest.raises(CustomError, match="custom failure") as info:
        dist("custom")
    assert isinstance(info.value, kt.RemoteError)
    _works(dist)


def test_unpicklable_exception_arrives_as_remote_exception(dist) -> None:
    with pytest.raises(kt.RemoteException) as info:
        dist("bad_exc")
    err = info.value
    assert isinstance(err, kt.RemoteError)
    assert err.type_name.endswith("BadExc")
    assert "raise BadExc" in err.remote_traceback
    assert "cannot rebuild me" in str(err)
    assert "rank 1" in str(err) and f"{NAME}-0" in str(err)
    assert [f.rank for f in err.failures] == [1]
    assert err.results == {0: 0, 2: 2, 3: 3}
    _works(dist)


def test_failure_while_others_block_fails_fast(dist) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 gave up") as info:
        dist("fail1_blocked")
    elapsed = time.monotonic() - start
    # the blocked ranks (60 s naps) were stopped, not waited for; no tighter stopwatch: a busy
    # machine is slow, not wrong
    assert elapsed < 60, f"the call took {elapsed:.1f}s to fail"
    err = info.value
    notes = "\n".join(err.__notes__)
    assert "rank 1" in notes
    assert err.failed_ranks == [0, 1, 2, 3]
    assert [f.rank for f in err.failures if f.kind == "error"] == [1]
    assert {f.kind for f in err.failures if f.rank != 1} <= {"cancelled"}
    assert err.results == {}
    _works(dist)


def test_failure_fails_fast_after_a_rank_died_between_calls(dist) -> None:
    """Rank 2's process exits after a call returned; the next call (which restarts it on
    pod 1) still stops every rank as soon as rank 1 fails, and honours its timeout."""
    assert dist.options(stream_logs=False)("die_later") == [0, 1, 2, 3]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(r["state"] == "dead" for r in dist.status()[1]["ranks"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("rank 2 did not exit")
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 gave up"):
        dist.options(stream_logs=False, timeout=8)("fail1_blocked", 20, 0)  # rank 1 fails at once
    elapsed = time.monotonic() - start
    # a ValueError, not the CallTimeout of timeout=8: the blocked ranks (20 s naps) were stopped
    assert elapsed < 20, f"the call took {elapsed:.1f}s to fail (rank 1 failed at once; timeout=8)"
    _works(dist)


def test_rank_exit_is_rank_died(dist) -> None:
    start = time.monotonic()
    with pytest.raises(kt.RankDied) as info:
        dist("exit3")
    assert time.monotonic() - start < 60  # the others' 60 s naps were stopped, not waited for
    err = info.value
    text = str(err)
    assert "exit" in text and "code 3" in text, text
    assert "rank 1" in text and f"{NAME}-0" in text
    died = [f for f in err.failures if f.kind == "died"]
    assert [f.rank for f in died] == [1]
    _works(dist)
    # the restarted rank reports its previous exit
    pod0 = dist.status()[0]
    assert [r["state"] for r in pod0["ranks"]] == ["idle", "idle"]


@pytest.fixture(scope="module")
def gloo():
    pytest.importorskip("torch")
    # max_restarts=1: rank processes ktlite itself kills after a failure must not count, so
    # repeated failing calls must never exhaust it
    remote = kt.fn(job, name="el-gloo").to(
        kt.Compute(cpus=1, max_restarts=1).distribute("pytorch", workers=2, num_proc=2)
    )
    yield remote
    remote.teardown()


@pytest.mark.timeout(150)
def test_failure_while_others_block_in_gloo_all_reduce(gloo) -> None:
    """Ranks 0, 2, 3 wait in an all_reduce that rank 1 never joins: the call still fails fast,
    and the next collective call, made right away, gets a fresh, complete process group.
    Two rounds: the recovery after a failure must work every time, not just once, the second
    time on ranks that a recovery started (and, with max_restarts=1, the ranks killed twice
    show that ktlite's own kills do not count as restarts)."""
    for round_ in range(2):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 skips the all_reduce") as info:
            gloo.options(stream_logs=False, timeout=40)("gloo", "fail")
        elapsed = time.monotonic() - start
        # a RuntimeError, not the CallTimeout: the ranks blocked in gloo were stopped
        assert elapsed < 40, f"round {round_}: the call took {elapsed:.1f}s to fail"
        assert isinstance(info.value, kt.RemoteError)
        notes = "\n".join(info.value.__notes__)
        assert "rank 1" in notes and "el-gloo-0" in notes
        # timeout: a broken pod would otherwise keep the call waiting in gloo's rendezvous
        assert gloo.options(stream_logs=False, timeout=40)("gloo") == [6.0, 6.0, 6.0, 6.0], round_
    assert gloo.options(stream_logs=False, timeout=40)("rank") == [0, 1, 2, 3]


# ---- 6. logs and options ---------------------------------------------------------------------


def test_logs_stream_with_rank_prefix(dist, capfd) -> None:
    capfd.readouterr()
    assert dist("print") == [0, 1, 2, 3]
    out, err = capfd.readouterr()
    for r in range(4):
        pod = f"{NAME}-{r // 2}"
        assert f"[rank {r} @ {pod}] out-line rank={r}" in out.splitlines()
        assert f"[rank {r} @ {pod}] second out-line rank={r}" in out.splitlines()
        assert f"[rank {r} @ {pod}] err-line rank={r}" in err.splitlines()
        assert f"err-line rank={r}" not in out
        assert f"out-line rank={r}" not in err
    # each rank's own lines keep their order
    lines = out.splitlines()
    for r in range(4):
        pod = f"{NAME}-{r // 2}"
        assert lines.index(f"[rank {r} @ {pod}] out-line rank={r}") < lines.index(
            f"[rank {r} @ {pod}] second out-line rank={r}"
        )


def test_logs_of_a_failing_call_still_arrive(dist, capfd) -> None:
    capfd.readouterr()
    with pytest.raises(ValueError):
        dist("fail1")
    out, _ = capfd.readouterr()
    # what the failing rank printed before raising reaches the caller
    assert f"[rank 1 @ {NAME}-0] rank 1 is about to fail" in out.splitlines()
    _works(dist)


def test_options_stream_logs_false_suppresses(dist, capfd) -> None:
    capfd.readouterr()
    assert dist.options(stream_logs=False)("print") == [0, 1, 2, 3]
    out, err = capfd.readouterr()
    assert _log_lines(out) == [] and _log_lines(err) == []
    assert "out-line" not in out + err


def test_kubetorch_stream_logs_kwarg_is_an_option(dist, capfd) -> None:
    # job has no stream_logs parameter and no **kwargs: the keyword is the call option
    capfd.readouterr()
    assert dist("print", stream_logs=False) == [0, 1, 2, 3]
    out, err = capfd.readouterr()
    assert _log_lines(out) == [] and _log_lines(err) == []


def test_compute_stream_logs_false_suppresses(quiet, capfd) -> None:
    capfd.readouterr()
    assert quiet(1) == (1, "default", "default", "default")
    out, err = capfd.readouterr()
    assert "takes_opts ran" not in out + err
    # a per-call option overrides the deployment's setting
    assert quiet.options(stream_logs=True)(2) == (2, "default", "default", "default")
    out, _ = capfd.readouterr()
    assert "[rank 0 @ el-quiet-0] takes_opts ran with x=2" in out.splitlines()


def test_user_parameter_named_stream_logs_is_not_swallowed(quiet, capfd) -> None:
    capfd.readouterr()
    # passed to the function, and NOT taken as the option (the deployment stays quiet)
    assert quiet(3, stream_logs=True) == (3, True, "default", "default")
    out, err = capfd.readouterr()
    assert "takes_opts ran" not in out + err
    assert quiet(4, stream_logs=False) == (4, False, "default", "default")


def test_user_parameter_named_workers_is_not_swallowed(quiet) -> None:
    # workers=[5] would be an invalid option on a 1-pod deployment: it must reach the function
    assert quiet(5, workers=[5]) == (5, "default", [5], "default")
    assert quiet(6, workers=[0], restart_procs=True) == (6, "default", [0], True)
    # the options form still works next to the user's own keywords
    assert quiet.options(workers=[0], stream_logs=False)(7, workers="mine") == (
        7,
        "default",
        "mine",
        "default",
    )


def test_user_kwargs_receive_kubetorch_keywords(kwdep, capfd) -> None:
    capfd.readouterr()
    got = kwdep(1, stream_logs=False, workers=[9], restart_procs=True)
    assert got == {"x": 1, "stream_logs": False, "workers": [9], "restart_procs": True}
    out, _ = capfd.readouterr()
    assert (
        "[rank 0 @ el-kwargs-0] takes_kwargs ran with x=1" in out.splitlines()
    )  # logs not disabled
    assert kwdep.options(stream_logs=False)(2, stream_logs=True) == {"x": 2, "stream_logs": True}
    out, _ = capfd.readouterr()
    assert "takes_kwargs ran" not in out


def test_kubetorch_workers_kwarg_is_an_option(dist) -> None:
    # job has no workers parameter: workers= selects pods
    assert dist("rank", workers=[1], stream_logs=False) == [2, 3]
    assert dist.options(workers=[0], stream_logs=False)("rank") == [0, 1]
    with pytest.raises(kt.ConfigError, match="workers"):
        dist("rank", workers=[7])
    _works(dist)


def test_call_timeout(dist) -> None:
    start = time.monotonic()
    with pytest.raises(kt.CallTimeout) as info:
        dist.options(timeout=1, stream_logs=False)("sleep", 30)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"timeout=1 took {elapsed:.1f}s"  # the 30 s nap was not waited for
    assert isinstance(info.value, TimeoutError)
    assert "timeout" in str(info.value)
    assert info.value.failed_ranks == [0, 1, 2, 3]
    _works(dist)


def test_invalid_timeout_option(dist) -> None:
    for bad in (0, -1, "5", True):
        with pytest.raises(kt.ConfigError, match="timeout"):
            dist.options(timeout=bad)
    with pytest.raises(kt.ConfigError, match="unknown call option"):
        dist.options(timeuot=5)


# ---- 10. bad input before anything starts ----------------------------------------------------


def test_unpicklable_function_names_the_global() -> None:
    before = _server_children()
    with pytest.raises(kt.SerializationError) as info:
        kt.fn(uses_lock).to(kt.Compute(cpus=1))
    msg = str(info.value)
    assert "_LOCK" in msg and "global" in msg
    assert "uses_lock" in msg
    assert isinstance(info.value, TypeError) and isinstance(info.value, kt.ConfigError)
    assert not _local_dir("uses-lock").exists()
    assert _server_children() == before


def test_unpicklable_argument_names_the_argument(dist, tmp_path) -> None:
    before = _server_children()
    marker = tmp_path / "ran"
    with pytest.raises(kt.SerializationError) as info:
        dist("touch", str(marker), extra=threading.Lock())
    assert "'extra'" in str(info.value) and "lock" in str(info.value).lower()
    with pytest.raises(kt.SerializationError) as info:
        dist("touch", [str(marker), threading.Lock()])
    assert "positional argument 1" in str(info.value)
    assert not marker.exists()
    assert _server_children() == before
    assert all(not pod["active_calls"] for pod in dist.status())
    _works(dist)


def test_gpus_beyond_machine_is_config_error() -> None:
    before = _server_children()
    want = len(visible_gpus()) + 1
    with pytest.raises(kt.ConfigError) as info:
        kt.fn(job, name="el-gpus").to(kt.Compute(cpus=1, gpus=want))
    assert "gpus" in str(info.value)
    with pytest.raises(kt.ConfigError, match="gpus"):
        kt.fn(job, name="el-gpus").to(
            kt.Compute(cpus=1, gpus=1).distribute("pytorch", workers=want)
        )
    assert not _local_dir("el-gpus").exists()
    assert _server_children() == before


def test_invalid_config_starts_nothing() -> None:
    before = _server_children()
    with pytest.raises(kt.ConfigError, match="workers"):
        kt.fn(job, name="el-bad").to(kt.Compute().distribute("pytorch", workers=0))
    with pytest.raises(kt.ConfigError):
        kt.fn(job, name="el-bad").to(kt.Compute().distribute("torch", workers=2))
    with pytest.raises(kt.ConfigError, match="name"):
        kt.fn(job, name="?").to(kt.Compute())
    assert not _local_dir("el-bad").exists()
    assert _server_children() == before
