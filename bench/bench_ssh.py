"""SSH-backend benchmark (issue 12): bring-up of 2 and 4 hosts, and warm calls beside the
local backend.

    python bench/bench_ssh.py [--runs 3] [--calls 200] [--json out.json]

Needs root and Debian's openssh-server: the hosts are real ``sshd`` s on loopback addresses
(``tests/ssh_hosts.py``), so "a host" is this machine reached over SSH, and the numbers are
ktlite's own costs (SSH handshakes, SFTP, the launcher, the server's start), not a network's.

Rows, medians of ``--runs``:

- bring-up, cold: from nothing to the first result of a one-rank-per-host function, with
  ktlite's source not yet on the hosts (``~/.cache/ktlite/src-*`` removed first: it is
  copied over SFTP and unpacked).
- bring-up, warm: the same with the source cached on the hosts (a new deployment, new
  servers); ``connect`` is the part spent opening the SSH connections.
- warm call: p50 of ``--calls`` calls of a no-op on 2 hosts x 2 ranks, against the same
  deployment on the local backend (2 pods x 2 ranks). Targets: warm bring-up of 4 hosts
  within 2 s once SSH connects; a warm call within 1.2x the local backend's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    _HOME = tempfile.mkdtemp(prefix="ktlite-bench-ssh-")
    os.environ["KTLITE_HOME"] = (
        _HOME  # before ktlite is imported: never share the tests' deployments
    )
    os.environ.pop("KTLITE_BACKEND", None)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _rounds import LoadLog  # noqa: E402

import ktlite as kt  # noqa: E402
from ktlite.backends import ssh as ssh_backend  # noqa: E402

clock = time.perf_counter


def noop() -> int:
    return 1


def _options(hosts, names: list[str]) -> kt.Hosts:
    return kt.Hosts(
        names,
        ssh_config=str(hosts.ssh_config),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
    )


def bring_up(hosts, count: int, name: str, cold: bool) -> tuple[float, float]:
    """Seconds to the first result, and the part spent connecting."""
    if cold:
        for path in glob.glob(os.path.expanduser("~/.cache/ktlite/src-*")):
            shutil.rmtree(path, ignore_errors=True)
    backend = ssh_backend.SshBackend.shared()
    spent: list[float] = []
    original = backend._connect

    async def timed(*args, **kwargs):
        t = clock()
        try:
            return await original(*args, **kwargs)
        finally:
            spent.append(clock() - t)

    backend._connect = timed
    try:
        t0 = clock()
        remote = kt.fn(noop, name=name).to(
            kt.Compute(
                hosts=_options(hosts, [h.name for h in hosts.hosts[:count]]), stream_logs=False
            )
        )
        assert remote() == [1] * count
        took = clock() - t0
    finally:
        backend._connect = original
    remote.teardown()
    return took, sum(spent)


def warm_calls(compute: kt.Compute, name: str, calls: int) -> list[float]:
    remote = kt.fn(noop, name=name).to(compute)
    for _ in range(20):
        remote()
    times = []
    for _ in range(calls):
        t = clock()
        remote()
        times.append(clock() - t)
    remote.teardown()
    return times


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def main() -> None:
    from ssh_hosts import SshHosts, sshd_available

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not sshd_available():
        raise SystemExit("needs /usr/sbin/sshd: apt-get install openssh-server")
    rows = []
    load = LoadLog()
    sshd_dir = Path(tempfile.mkdtemp(prefix="ktlite-bench-sshd-"))
    try:
        with SshHosts(sshd_dir, 4) as hosts:
            for count in (2, 4):
                for cold in (True, False):
                    with load.step(
                        f"bring-up {count} hosts, {'cold' if cold else 'warm'} x{args.runs}"
                    ):
                        runs = [
                            bring_up(hosts, count, f"bench-ssh-{count}-{int(cold)}-{i}", cold)
                            for i in range(args.runs)
                        ]
                    took = statistics.median(t for t, _ in runs)
                    connect = statistics.median(c for _, c in runs)
                    rows.append(
                        (f"bring-up {count} hosts, {'cold' if cold else 'warm'}", took, connect)
                    )
            with load.step(f"warm calls, ssh x{args.calls}"):
                ssh = warm_calls(
                    kt.Compute(
                        hosts=_options(hosts, ["host0", "host1"]), stream_logs=False
                    ).distribute("pytorch", num_proc=2),
                    "bench-ssh-warm",
                    args.calls,
                )
        with load.step(f"warm calls, local x{args.calls}"):
            local = warm_calls(
                kt.Compute(stream_logs=False).distribute("pytorch", workers=2, num_proc=2),
                "bench-local-warm",
                args.calls,
            )
    finally:
        shutil.rmtree(os.environ["KTLITE_HOME"], ignore_errors=True)
        shutil.rmtree(sshd_dir, ignore_errors=True)
    print(load.summary())
    print(f"{'measurement':<34} {'total':>9} {'connect':>9} {'after connect':>14}")
    print(f"{'-' * 34} {'-' * 9} {'-' * 9} {'-' * 14}")
    for name, took, connect in rows:
        print(f"{name:<34} {_ms(took):>9} {_ms(connect):>9} {_ms(took - connect):>14}")
    p50_ssh, p50_local = statistics.median(ssh), statistics.median(local)
    print(
        f"\nwarm call, 2 hosts x 2 ranks (p50 of {args.calls}): ssh {_ms(p50_ssh)}, local {_ms(p50_local)}, "
        f"ratio {p50_ssh / p50_local:.2f}x"
    )
    print(
        "load average (1 min) before -> after each step:\n"
        + "\n".join(f"  {line}" for line in load.lines())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bring_up": [{"name": n, "total_s": t, "connect_s": c} for n, t, c in rows],
                    "warm_call_p50_s": {"ssh": p50_ssh, "local": p50_local},
                    "load": load.as_json(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
