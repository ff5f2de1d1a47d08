"""Starting N ranks on one machine (issue 26): ktlite beside torchrun, Monarch and Ray.

    python bench/bench_ranks.py --peer-python .venv/bin/python      # N = 8 and 64, 3 rounds
    python bench/bench_ranks.py --ranks 8,64 --rounds 3 --json out.json
    python bench/bench_ranks.py --skip-peers --quick --ranks 2      # ktlite rows only, 1 round

Rows, for each N (the table prints each one's median over the rounds):

- ktlite, forked ranks: ``kt.fn(noop).to(kt.Compute(cpus=0.5).distribute("spmd",
  num_proc=N))`` under a fresh name (a new pod), then the first call: "cold" is the wall time
  of both (each also apart), "CPU" what the pod's processes (the pod server, its rank zygote,
  the ranks: every process below the pod server, ``bench/_proc_tree.py``) had spent when the
  first call returned, "PSS" theirs after a few more calls; then torn down. The bench checks
  that the ranks were forked: one ``ktlite_server.rankzygote`` child of the pod server, N
  children of it.
- ktlite, exec'd ranks: the same with ``KTLITE_RANK_ZYGOTE=0``, each rank started as ``python
  -m ktlite_server.rank``. The local backend does not pass the caller's ``KTLITE_*`` variables
  to its pods (``local_pods._env``), so the row sets it in the pod's own environment
  (``Compute(env=...)``) and checks that every rank is a ``ktlite_server.rank`` process whose
  parent is the pod server, and that there is no zygote.
- torchrun: ``python -m torch.distributed.run --standalone --nproc_per_node=N`` of
  ``bench/_ranks_noop.py``, whose ranks import nothing and exit at once: the row is torchrun's
  agent (its c10d rendezvous included) and the start of N Pythons, no job. Wall time of the
  launch, and the CPU of its whole tree (``os.wait4``'s rusage: the agent and every rank it
  waited for). Its ranks are gone when it ends: no PSS.
- Monarch: ``this_host().spawn_procs(per_host={"gpus": N})``, an actor spawned on each and
  one endpoint call to all, timed to that call's answer; CPU and PSS of the processes that
  appeared below the peer process (the procs), not of the controller (the driver, as
  ktlite's client is not counted either).
- Ray: ``ray.init()`` once, untimed; then N actors created and one method call on each,
  timed to the last answer; CPU and PSS of the actors' worker processes, told apart from
  Ray's daemons (GCS, raylet, agents, idle workers) by asking each actor its pid. Ray may
  hand an actor a worker it started ahead (at ``ray.init``); its CPU counts from that start.

ktlite's rows run in this process; each peer in a process of its own (``_ranks_peers.py``;
``--peer-python``: a venv with the bench extra), torchrun as a command of that Python. The
systems take turns round by round (``_rounds.run_rounds``, the order rotated), the load
average recorded before and after each round. Ratios are ktlite (forked) / the row's. A
private KTLITE_HOME; every deployment is torn down after its round (and at exit); a peer that
fails to start is reported with its error and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-ranks-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)
sys.path.insert(0, str(HERE))

from _peer_link import PeerProcess  # noqa: E402
from _proc_tree import children, cmdline, cpu_seconds, descendants, parent, pss_mib  # noqa: E402
from _rounds import LoadLog, clock, run_rounds  # noqa: E402

import ktlite as kt  # noqa: E402

FORKED, EXECD = "ktlite, forked ranks", "ktlite, exec'd ranks"
TORCHRUN, MONARCH, RAY = "torchrun launch", "Monarch procs+actors+call", "Ray actors+call"
PEERS = {"ray": RAY, "monarch": MONARCH}
ROUND_TIMEOUT = 600.0  # one system's round; 64 Pythons on a busy 2-core machine take a minute
GONE_S = 30.0


def noop() -> None:
    return None


def one_line(e: BaseException) -> str:
    """An error in one line: a peer's carries its traceback; its first and last lines say it."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(e).__name__}: {text}"[:400]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- ktlite ------------------------------------------------------------------------------


def pod_server(name: str) -> int:
    """The pid of deployment ``name``'s pod server: a child of this process (local backend)."""
    for pid in children(os.getpid()):
        cmd = cmdline(pid).split()
        if "ktlite_server" in cmd and f"{name}-0" in cmd:
            return pid
    raise RuntimeError(f"no pod server of {name!r} among this process's children")


def check_ranks(pod: int, tree: list[int], n: int, forked: bool) -> str:
    """How the pod's ranks were started; RuntimeError when not as the row says."""
    # a forked rank keeps the zygote's command line: the zygote is the one the pod started
    zygotes = [
        p for p in tree if parent(p) == pod and "ktlite_server.rankzygote" in cmdline(p).split()
    ]
    if forked:
        if len(zygotes) != 1:
            raise RuntimeError(f"expected one rank zygote child of the pod server: {zygotes}")
        ranks = [p for p in tree if parent(p) == zygotes[0]]
        how = "forked by the pod's rank zygote (ktlite_server.rankzygote)"
    else:
        if zygotes:
            raise RuntimeError(f"KTLITE_RANK_ZYGOTE=0, yet rank zygote(s) {zygotes} run")
        ranks = [p for p in tree if parent(p) == pod and "ktlite_server.rank" in cmdline(p).split()]
        how = "exec'd by the pod server (python -m ktlite_server.rank)"
    if len(ranks) != n:
        raise RuntimeError(f"expected {n} ranks {how}, found {len(ranks)}")
    return how


def wait_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the torn-down pod's processes still run after {within:g} s")
        time.sleep(0.05)  # polling other processes' exits, bounded above


def ktlite_ranks(n: int, tag: str, forked: bool, warm: int) -> dict[str, Any]:
    env = {} if forked else {"env": {"KTLITE_RANK_ZYGOTE": "0"}}
    compute = kt.Compute(cpus=0.5, **env).distribute("spmd", num_proc=n)
    name = f"bench-ranks-{'f' if forked else 'x'}{n}-{tag}"
    t0 = clock()
    remote = kt.fn(noop, name=name).to(compute)
    t1 = clock()
    tree: list[int] = []
    try:
        remote()
        t2 = clock()
        pod = pod_server(name)
        tree = [pod, *descendants(pod)]
        cpu = cpu_seconds(tree)
        how = check_ranks(pod, tree, n, forked)
        for _ in range(warm):
            remote()
        tree = [pod, *descendants(pod)]
        pss = pss_mib(tree)
    finally:
        remote.teardown()
        wait_gone(tree, GONE_S)
    return {
        "wall_s": t2 - t0,
        "to_s": t1 - t0,
        "call_s": t2 - t1,
        "cpu_s": cpu,
        "pss_mib": pss,
        "procs": len(tree),
        "how": how,
    }


# ---- torchrun ----------------------------------------------------------------------------


def torchrun(python: str, n: int, timeout: float) -> dict[str, Any]:
    """One launch of ``n`` no-op ranks: its wall time and its whole tree's CPU (``wait4``)."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's warning about it, otherwise
    with tempfile.TemporaryFile() as out:
        t = clock()
        proc = subprocess.Popen(
            [*cmd, str(HERE / "_ranks_noop.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            pidfd = os.pidfd_open(proc.pid)
            try:
                if not select.select([pidfd], [], [], timeout)[0]:
                    raise TimeoutError(f"torchrun ran past {timeout:g} s")
            finally:
                os.close(pidfd)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = clock() - t
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # its session, whatever is left of it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
                proc.wait(10)
        if proc.returncode != 0:
            out.seek(0)
            tail = out.read().decode(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"torchrun exited with {proc.returncode}: {' | '.join(tail)}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "pss_mib": None,
        "procs": n + 1,
    }


# ---- the run -----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.warm = 1 if args.quick else 3
        self.load = LoadLog()
        self.samples: dict[int, dict[str, list[dict[str, Any]]]] = {}
        self.errors: dict[str, str] = {}  # system -> why it has no (or fewer) rounds
        self.peers: dict[str, PeerProcess] = {}
        self.versions: dict[str, str] = {"ktlite": kt.__version__}
        self.torchrun = False

    def start_peers(self) -> None:
        python, most = self.args.peer_python, max(self.args.ranks)
        for engine, system in PEERS.items():
            log(f"starting the {engine} peer")
            try:
                with self.load.step(f"start {engine}"):
                    peer = PeerProcess(
                        system,
                        [python, str(HERE / "_ranks_peers.py"), engine, "--most", str(most)],
                        start_timeout=300,
                    )
                self.peers[system] = peer
                self.versions[engine] = peer.ready["version"]
            except Exception as e:  # noqa: BLE001 - the other rows still run
                self.errors[system] = f"did not start: {one_line(e)}"
                log(f"{engine} FAILED to start: {e}")
        try:
            check = subprocess.run(
                [python, "-c", "import torch; print(torch.__version__)"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if check.returncode != 0:
                raise RuntimeError(check.stderr.strip().splitlines()[-1:])
            self.versions["torch"] = check.stdout.strip()
            self.torchrun = True
            torchrun(python, 1, ROUND_TIMEOUT)  # not counted: reads torch's files into the cache
        except Exception as e:  # noqa: BLE001 - the other rows still run
            self.errors[TORCHRUN] = f"did not start: {one_line(e)}"
            self.torchrun = False

    def systems(self, n: int) -> dict[str, Callable[[int], dict[str, Any]]]:
        """What one round of each system measures at ``n`` ranks (given the round's index)."""
        out: dict[str, Callable[[int], dict[str, Any]]] = {
            FORKED: lambda r: ktlite_ranks(n, f"r{r}", True, self.warm),
            EXECD: lambda r: ktlite_ranks(n, f"r{r}", False, self.warm),
        }
        if self.torchrun:
            out[TORCHRUN] = lambda r: torchrun(self.args.peer_python, n, ROUND_TIMEOUT)
        for system, peer in self.peers.items():
            out[system] = lambda r, p=peer: p.ask("start", ROUND_TIMEOUT, n=n, warm=self.warm)
        return out

    def shown(self) -> list[str]:
        """The systems of the table, in its order: those measured and those that failed."""
        every = [FORKED, EXECD] + ([] if self.args.skip_peers else [TORCHRUN, MONARCH, RAY])
        return every

    def run(self) -> None:
        for n in self.args.ranks:
            taken = self.samples.setdefault(n, {s: [] for s in self.shown()})

            def failed(system: str, e: BaseException, n: int = n) -> None:
                self.errors[f"{system}, {n} ranks"] = one_line(e)
                log(f"{n} ranks, {system} FAILED: {type(e).__name__}: {e}")

            def taking(
                system: str,
                measure: Callable[[int], dict[str, Any]],
                n: int = n,
                taken: dict[str, list[dict[str, Any]]] = taken,
            ) -> Callable[[int], None]:
                def one(r: int) -> None:
                    got = measure(r)
                    taken[system].append(got)
                    log(f"{n} ranks, {system}: {got['wall_s']:.2f} s, CPU {got['cpu_s']:.2f} s")

                return one

            systems = {s: taking(s, m) for s, m in self.systems(n).items()}
            run_rounds(f"{n} ranks", systems, self.args.rounds, self.load, failed)

    def close(self) -> None:
        for peer in self.peers.values():
            with contextlib.suppress(Exception):
                peer.close()
        for pid in children(os.getpid()):  # a pod a failed round left up: its server stops it
            if "ktlite_server" in cmdline(pid).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:.0f} MiB"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}"


def table(bench: Bench) -> list[list[str]]:
    """One row per N and system: medians, and ktlite (forked) / that system."""
    rows = []
    for n, systems in bench.samples.items():
        ours = systems.get(FORKED, [])
        for system, got in systems.items():
            why = bench.errors.get(f"{system}, {n} ranks") or bench.errors.get(system)
            if not got:
                short = (why or "no rounds").rsplit(" ... ", 1)[-1]
                rows.append([str(n), system, f"failed: {short}"[:120]])
                continue
            walls = [g["wall_s"] for g in got]
            cold = _fmt(_median(got, "wall_s"), "s")
            if "to_s" in got[0]:
                cold += f" (.to() {_fmt(_median(got, 'to_s'), 's')})"
            rows.append(
                [
                    str(n),
                    system,
                    cold,
                    f"{_fmt(min(walls), 's')}-{_fmt(max(walls), 's')}",
                    _fmt(_median(got, "cpu_s"), "s"),
                    _fmt(_median(got, "pss_mib"), "MiB"),
                    str(got[-1]["procs"]),
                    *(
                        ["", "", ""]
                        if system == FORKED
                        else [
                            _ratio(_median(ours, k), _median(got, k))
                            for k in ("wall_s", "cpu_s", "pss_mib")
                        ]
                    ),
                ]
            )
    return rows


def render(rows: list[list[str]], header: list[str]) -> str:
    every = [header, *rows]
    widths = [max(len(r[i]) for r in every if len(r) == len(header)) for i in range(len(header))]
    lines = []
    for k, r in enumerate(every):
        if len(r) < len(header):  # a failed row: its text runs on
            lines.append("  ".join([r[0].rjust(widths[0]), r[1].ljust(widths[1]), *r[2:]]))
            continue
        cells = [
            c.ljust(w) if i == 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


HEADER = ["N", "system", "cold (median)", "rounds", "CPU", "PSS", "procs", "x cold", "x CPU"]
HEADER.append("x PSS")


def report(bench: Bench, seconds: float) -> None:
    args = bench.args
    versions = ", ".join(f"{k} {v}" for k, v in bench.versions.items())
    print(
        f"\nstarting N ranks on one machine{' (--quick)' if args.quick else ''}: Python "
        f"{platform.python_version()}, {os.cpu_count()} CPU(s), {seconds:.0f} s; {versions}; "
        f"{args.rounds} round(s), systems in turn (order rotated); PSS after {bench.warm} "
        "warm call(s)"
    )
    print(bench.load.summary())
    print("x = ktlite (forked ranks) / the row's: below 1, ktlite spends less\n")
    print(render(table(bench), HEADER))
    hows = {g["how"] for s in bench.samples.values() for r in s.values() for g in r if "how" in g}
    print("\nhow ktlite's ranks started (checked each round):")
    for how in sorted(hows):
        print(f"  {how}")
    print("\nload average (1 min) before -> after each round:")
    print("\n".join(f"  {line}" for line in bench.load.lines()))
    if bench.errors:
        print("\nerrors:")
        print("\n".join(f"- {k}: {v}" for k, v in bench.errors.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": args.ranks,
                    "rounds": args.rounds,
                    "quick": args.quick,
                    "versions": bench.versions,
                    "samples": {str(n): s for n, s in bench.samples.items()},
                    "errors": bench.errors,
                    "load": bench.load.as_json(),
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ranks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[8, 64],
        help="comma-separated N",
    )
    p.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--quick", action="store_true", help="1 round, 1 warm call before the PSS")
    p.add_argument(
        "--peer-python",
        default=sys.executable,
        metavar="PATH",
        help="the Python that runs torchrun, Ray and Monarch (a venv with the bench extra)",
    )
    p.add_argument("--skip-peers", action="store_true", help="ktlite rows only")
    p.add_argument("--json", metavar="PATH", help="also write every sample to PATH")
    args = p.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the cleanup below

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args)
    started = clock()
    try:
        if not args.skip_peers:
            bench.start_peers()
        bench.run()
    finally:
        bench.close()
        shutil.rmtree(_HOME, ignore_errors=True)
    report(bench, clock() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
