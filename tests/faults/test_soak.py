"""Issue 4 "Proof": a bounded soak that checks nothing leaks.

Two deployments - ``soak-single`` (1 pod × 1 proc) and ``soak-dist`` (2 pods × 2 procs) - get
a few hundred calls in a fixed shuffled order: plain calls, calls with 2 MiB arguments and
results (the shared-memory path), gloo all_reduce calls, and calls failing on purpose (a
rank raises, a rank ``os._exit``s, a call timeout, a rank raising while its peers block in
an all_reduce). Counted before and after, from ``/proc``, after a warm-up so first-time
costs do not count, and with the rank processes freshly restarted at both points:

- each pod server: child processes, threads, open fds, listening / established / other TCP
  sockets, other sockets (unix);
- the rank processes together (same counts), and, over a stretch of plain calls on the
  same rank processes, each rank process's threads and fds;
- this test process: threads, fds, sockets;
- zombies under the pod servers and this process.

After teardown no process of either deployment may remain (found by a marker in their
environment: pod servers, rank processes, anything they started, orphans included) and no
``/dev/shm/ktlite-*`` file may be left behind. A small fixed slack is allowed; growth with the
number of calls fails. The counts are printed (run with ``-s`` to see them).

What the soak turned up has its own strict xfail test below: a collective call after a
failure that one pod reported last, the dead ranks' pipes kept until GC, and the caller's
keep-alive sockets to torn-down pods. Until the first is fixed, the soak's collective calls
restart the rank processes (``restart_procs=True``).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

import hostile_mod as hm
import pytest

import ktlite as kt

SINGLE = "soak-single"
DIST = "soak-dist"
MARK = ("SOAK_MARK", uuid.uuid4().hex)  # in the env of every process of these deployments
BIG = 2 << 20  # above shm.INLINE_MAX: arguments and results travel through /dev/shm
# every big payload starts with this, so a /dev/shm file left behind is known as this test's by
# its content (other ktlite processes on the machine, other tests included, make files there too)
STAMP = f"soak-{MARK[1]}".encode()
# without torch: no gloo calls. Found, not imported: importing it here would cost every process
# that collects the suite (each xdist worker) a torch import (~1.7 CPU-s) that only the ranks need
TORCH = importlib.util.find_spec("torch") is not None
WORLD = 4

# per-process slack (servers and the test process) and for the rank processes together.
# Pipes get more: a pod server keeps the stdout/stderr pipes of dead rank processes until its
# garbage collector runs (test_dead_rank_pipes_are_closed_at_once), so their count churns.
# A permanent leak would show anyway: the soak kills rank processes ~100 times (2 pipes each).
SLACK = {
    "children": 0,
    "threads": 2,
    "fds": 28,
    "pipes": 24,
    "non_pipe_fds": 4,
    "listen": 0,
    "established": 2,
    "tcp_other": 4,
    "other_sockets": 2,
    "processes": 0,
}


def soak_fn(mode: str, arg: Any = None, who: int = 0) -> Any:
    rank = int(os.environ["RANK"])
    if mode == "ok":
        return (rank, arg)
    if mode == "big":
        return bytes(arg)
    if mode == "raise":
        if rank == who:
            raise ValueError(f"soak failure on purpose on rank {rank}")
        return rank
    if mode == "late_raise":
        if rank == who:
            time.sleep(float(arg))
            raise ValueError(f"late failure on purpose on rank {rank}")
        return rank
    if mode == "big_raise":
        if rank == who:
            raise ValueError(f"soak failure with a {len(arg)}-byte argument")
        return len(arg)
    if mode == "exit":
        if rank == who:
            os._exit(3)
        return rank
    if mode == "sleep":
        time.sleep(float(arg))
        return rank
    if mode in ("gloo", "gloo_fail"):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(rank)])
        if mode == "gloo_fail" and rank == who:
            time.sleep(0.2)
            raise ValueError(f"rank {rank} skips the all_reduce")
        dist.all_reduce(t)
        return t.item()
    raise AssertionError(mode)


@pytest.fixture(scope="module")
def deployments():
    shm_before = hm.shm_files()
    me_before = hm.usage(os.getpid())
    compute = kt.Compute(cpus=1, stream_logs=False, max_restarts=100_000, env=dict([MARK]))
    single = kt.fn(soak_fn, name=SINGLE).to(compute)
    try:
        dist = kt.fn(soak_fn, name=DIST).to(compute.distribute("spmd", workers=2, num_proc=2))
    except BaseException:
        single.teardown()
        raise
    yield {"single": single, "dist": dist, "shm_before": shm_before, "me_before": me_before}
    single.teardown()
    dist.teardown()


# ---- the calls -----------------------------------------------------------------------------------


def _run(kind: str, remote, i: int) -> str:
    """One call of ``kind`` on ``remote``; checks its value or its error. Returns the outcome."""
    distributed = remote.name == DIST
    world = WORLD if distributed else 1
    who = i % world

    def val(v: Any) -> Any:
        return v if distributed else [v]

    if kind == "ok":
        got = remote("ok", i)
        assert val(got) == [(r, i) for r in range(world)]
    elif kind == "big":
        payload = _big(i % 251)
        got = remote("big", payload)
        assert val(got) == [payload] * world
    elif kind == "gloo":
        # fresh rank processes for every collective call: see
        # test_collective_after_a_failure_reported_last_works for why (a stale process group)
        assert remote.options(restart_procs=True)("gloo") == [6.0] * WORLD
    elif kind in ("raise", "big_raise", "gloo_fail"):
        arg = _big(0) if kind == "big_raise" else None
        call = remote.options(restart_procs=True) if kind == "gloo_fail" else remote
        with pytest.raises(ValueError) as info:
            call(kind, arg, who=who)
        assert isinstance(info.value, kt.RemoteError) and who in info.value.failed_ranks
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert f"rank {who} on pod" in notes, notes
    elif kind == "exit":
        with pytest.raises(kt.RankDied) as died:
            remote("exit", who=who)
        assert "code 3" in str(died.value) and who in died.value.failed_ranks
    elif kind == "timeout":
        start = time.monotonic()
        with pytest.raises(kt.CallTimeout):
            remote.options(timeout=0.4)("sleep", 30)
        assert time.monotonic() - start < 10
    else:
        raise AssertionError(kind)
    return kind


def _big(byte: int) -> bytes:
    return STAMP + bytes([byte]) * (BIG - len(STAMP))


def _our_shm_files(before: set[str]) -> list[str]:
    """The /dev/shm files made since ``before`` that hold one of this test's payloads."""
    ours = []
    for name in sorted(hm.shm_files() - before):
        try:
            data = Path("/dev/shm", name).read_bytes()
        except OSError:  # gone meanwhile
            continue
        if STAMP in data:
            ours.append(name)
    return ours


def _schedule(seed: int) -> list[tuple[str, str]]:
    single = (
        ["ok"] * 150
        + ["big"] * 10
        + ["raise"] * 10
        + ["big_raise"] * 3
        + ["exit"] * 8
        + ["timeout"] * 6
    )
    dist = (
        ["ok"] * 100
        + ["big"] * 6
        + ["raise"] * 8
        + ["big_raise"] * 2
        + ["exit"] * 6
        + ["timeout"] * 5
        # one of each collective kind: each runs on fresh rank processes (a torch import in
        # every rank, seconds), and their restarts are counted with the exits' dozen anyway
        + (["gloo", "gloo_fail"] if TORCH else [])
    )
    calls = [("single", k) for k in single] + [("dist", k) for k in dist]
    random.Random(seed).shuffle(calls)
    return calls


def _normalize(deps: dict[str, Any]) -> None:
    """Fresh rank processes everywhere, then a plain call: the same state at both counts."""
    for key in ("single", "dist"):
        remote = deps[key]
        remote.options(restart_procs=True)("ok", -1)
        remote("ok", -2)
        remote.status()
    # killed rank processes reaped and closed connections gone: _settled() waits for that


# ---- counting -----------------------------------------------------------------------------------


def _servers() -> dict[str, list[int]]:
    return {name: [p["pid"] for p in hm.read_state(name)["pods"]] for name in (SINGLE, DIST)}


def _kinds(pid: int) -> dict[str, int]:
    """fd targets by kind (socket, pipe, anon_inode:[pidfd], a path), for failure messages."""
    return dict(collections.Counter(t.split("[")[0] if "[" in t else t for t in hm.fd_targets(pid)))


def _snapshot() -> dict[str, Any]:
    servers = _servers()
    spids = [pid for pids in servers.values() for pid in pids]
    ranks = [c for pid in spids for c in hm.rank_processes(pid) if hm.alive(c)]
    zygotes = [z for pid in spids for z in hm.zygotes(pid)]
    me = os.getpid()
    return {
        "servers": {pid: hm.usage(pid).row() for pid in spids},
        "server_fds": {pid: _kinds(pid) for pid in spids},
        "ranks": hm.total(hm.usage(pid) for pid in ranks),
        "rank_pids": sorted(ranks),
        "rank_each": {pid: hm.usage(pid).row() for pid in ranks},
        "me": {**hm.usage(me).row(), "children": len([c for c in hm.children(me) if hm.alive(c)])},
        "zombies": hm.zombies([*spids, *zygotes, me]),
    }


def _settled() -> dict[str, Any]:
    """A snapshot once two in a row (0.3 s apart) agree: killed rank processes reaped, closed
    connections gone."""
    last = _snapshot()
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = _snapshot()
        keys = ("servers", "ranks", "rank_pids", "me", "zombies")
        if all(now[k] == last[k] for k in keys):
            return now
        last = now
    return last


def _growth(before: dict[str, int], after: dict[str, int], what: str) -> list[str]:
    return [
        f"{what}: {k} {before[k]} -> {after[k]} (slack {SLACK.get(k, 0)})"
        for k in before
        if after.get(k, 0) - before[k] > SLACK.get(k, 0)
    ]


def _table(title: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    lines = [title]
    for label, b, a in [
        (f"pod server {pid}", before["servers"][pid], after["servers"].get(pid, {}))
        for pid in before["servers"]
    ] + [
        ("rank processes (all)", before["ranks"], after["ranks"]),
        ("test process", before["me"], after["me"]),
    ]:
        lines.append(f"  {label:24} " + "  ".join(f"{k}={b[k]}->{a.get(k)}" for k in b))
    lines.append(f"  zombies {before['zombies']} -> {after['zombies']}")
    for pid in before["server_fds"]:
        lines.append(
            f"  fds of {pid}: {before['server_fds'][pid]} -> {after['server_fds'].get(pid)}"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def pg_dist():
    remote = kt.fn(soak_fn, name="soak-pg").to(
        kt.Compute(cpus=1, stream_logs=False).distribute("spmd", workers=2, num_proc=2)
    )
    yield remote
    remote.teardown()


@pytest.mark.skipif(not TORCH, reason="needs torch (gloo)")
@pytest.mark.timeout(120)
def test_collective_after_a_failure_reported_last_works(pg_dist) -> None:
    assert pg_dist("gloo") == [6.0] * WORLD  # every rank now holds a process group
    for who in (2, 0):  # the failing rank's pod answers last: pod 1, then pod 0 (the coordinator)
        with pytest.raises(ValueError):
            pg_dist("late_raise", 0.5, who=who)
        assert pg_dist.options(timeout=30)("gloo") == [6.0] * WORLD


@pytest.mark.timeout(240)
def test_soak_leaks_nothing(deployments) -> None:
    deps = deployments
    t0 = time.monotonic()
    # warm-up: every kind of call that runs on the same rank processes once, so first-time
    # costs (imports, pools) are paid. Not the collective kinds: each of those runs on fresh
    # rank processes (restart_procs, as _normalize's calls do), whose first-time costs are
    # theirs alone, and each costs a torch import in every rank
    for key, kinds in (
        ("single", ["ok", "big", "raise", "exit", "timeout"]),
        ("dist", ["ok", "big", "raise", "exit", "timeout"]),
    ):
        for i, kind in enumerate(kinds):
            _run(kind, deps[key], i)
    _normalize(deps)
    before = _settled()
    servers_before = _servers()

    counts: dict[str, int] = {}
    durations: dict[str, float] = {}
    t_soak = time.monotonic()
    for i, (key, kind) in enumerate(_schedule(seed=4)):
        start = time.monotonic()
        _run(kind, deps[key], i)
        label = f"{key}:{kind}"
        counts[label] = counts.get(label, 0) + 1
        durations[label] = durations.get(label, 0.0) + time.monotonic() - start
    soak_s = time.monotonic() - t_soak
    _normalize(deps)
    after = _settled()
    assert _servers() == servers_before, "a pod server was restarted during the soak"

    # a stretch of plain and big calls on the same rank processes: per-process growth
    steady_before = after["rank_each"]
    for i in range(60):
        _run("ok", deps["single"], i)
        _run("ok", deps["dist"], i)
        if i % 6 == 0:
            _run("big", deps["single"], i)
            _run("big", deps["dist"], i)
    steady = _settled()

    total_calls = sum(counts.values())
    report = {
        "calls": total_calls,
        "by_kind": counts,
        "soak_s": round(soak_s, 1),
        "mean_ms": {k: round(1000 * durations[k] / counts[k], 1) for k in sorted(counts)},
        "before": before,
        "after": after,
        "steady_rank_each": {"before": steady_before, "after": steady["rank_each"]},
    }
    print("\nSOAK " + json.dumps(report, default=str))
    print(_table(f"soak: {total_calls} calls in {soak_s:.1f}s (before -> after)", before, after))
    print(_table("steady stretch of 140 plain/big calls (after -> steady)", after, steady))

    problems: list[str] = []
    for pid, row in before["servers"].items():
        problems += _growth(row, after["servers"][pid], f"pod server {pid}")
        problems += _growth(
            after["servers"][pid], steady["servers"][pid], f"pod server {pid} (steady)"
        )
    problems += _growth(before["ranks"], after["ranks"], "rank processes")
    problems += _growth(before["me"], after["me"], "test process")
    problems += _growth(after["me"], steady["me"], "test process (steady)")
    if steady["rank_pids"] != after["rank_pids"]:
        problems.append(
            f"rank processes changed during plain calls: {after['rank_pids']} -> "
            f"{steady['rank_pids']}"
        )
    else:
        for pid, row in steady_before.items():
            problems += _growth(row, steady["rank_each"][pid], f"rank process {pid} (steady)")
    if len(after["rank_pids"]) != 1 + WORLD:
        problems.append(f"{len(after['rank_pids'])} rank processes, expected {1 + WORLD}")
    zombies = hm.wait_for(lambda: not _snapshot()["zombies"], timeout=3.0)
    if not zombies:
        problems.append(f"zombie processes: {_snapshot()['zombies']}")
    if problems:
        problems.append(
            f"server fds by kind, before: {before['server_fds']}, after: "
            f"{after['server_fds']}, steady: {steady['server_fds']}"
        )
    assert not problems, "\n".join(problems)

    # teardown: nothing of either deployment remains (found by the marker in their env, so
    # orphans and anything the ranks started count too, and other sessions' pods do not)
    ours = hm.with_env("=".join(MARK))
    assert set(ours) >= set(before["servers"]) | set(steady["rank_pids"])
    ports = set().union(*(hm.listen_ports_of(pid) for pid in ours))
    deps["single"].teardown()
    deps["dist"].teardown()
    gone = hm.wait_for(
        lambda: not (hm.with_env("=".join(MARK)) or hm.pod_pids(SINGLE) or hm.pod_pids(DIST)),
        timeout=10.0,
    )
    left = hm.with_env("=".join(MARK))
    assert gone, (
        f"left running after teardown: {left} "
        f"{[Path(f'/proc/{p}/cmdline').read_bytes()[:120] for p in left]}, "
        f"listening on {[sorted(hm.listen_ports_of(p) & ports) for p in left]}"
    )
    assert not hm.local_dir(SINGLE).exists() and not hm.local_dir(DIST).exists()
    leftover = hm.wait_for(lambda: not _our_shm_files(deps["shm_before"]), timeout=5.0)
    assert leftover, f"/dev/shm files left behind: {_our_shm_files(deps['shm_before'])}"
    me_after = hm.usage(os.getpid())
    print(
        f"test process before deploy -> after teardown: {deps['me_before'].row()} -> {me_after.row()}"
    )
    print(f"soak total wall {time.monotonic() - t0:.1f}s")
    # idle keep-alive sockets to the torn-down pods are test_teardown_closes_client_connections
    assert me_after.threads - deps["me_before"].threads <= 4  # the deploy thread pool, bounded


@pytest.mark.timeout(60)
def test_teardown_closes_client_connections() -> None:
    remote = kt.fn(soak_fn, name="soak-conns").to(
        kt.Compute(cpus=1, stream_logs=False).distribute("spmd", workers=2, num_proc=1)
    )
    try:
        ports = {p["port"] for p in hm.read_state("soak-conns")["pods"]}
        assert remote("ok", 1) == [(0, 1), (1, 1)]
        remote.status()
        assert ports & set(hm.tcp_peer_ports(os.getpid())), (
            "no connection to the pods to begin with"
        )
    finally:
        remote.teardown()
    left = hm.wait_for(lambda: not ports & set(hm.tcp_peer_ports(os.getpid())), timeout=3.0)
    assert left, (
        f"sockets to torn-down pods still open: "
        f"{sorted(p for p in hm.tcp_peer_ports(os.getpid()) if p in ports)}"
    )


@pytest.mark.timeout(60)
def test_dead_rank_pipes_are_closed_at_once() -> None:
    single = kt.fn(soak_fn, name="soak-pipes").to(
        kt.Compute(cpus=1, stream_logs=False, max_restarts=100)
    )
    try:
        server = hm.read_state("soak-pipes")["pods"][0]["pid"]
        assert single("ok", -1) == (0, -1)
        baseline = hm.usage(server).pipes  # its own, and the live rank's stdout and stderr
        extra = []
        for i in range(4):
            with pytest.raises(kt.RankDied):
                single("exit")
            assert single("ok", i) == (0, i)
            if not hm.wait_for(lambda: hm.usage(server).pipes == baseline, timeout=1.0):
                extra.append(hm.usage(server).pipes)
    finally:
        single.teardown()
    assert not extra, (
        f"pipes held by the pod server after each rank death ({baseline} before the first): {extra}"
    )
