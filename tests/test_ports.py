"""MASTER_PORT on the local backend: two live deployments never share one (they would join
each other's rendezvous and hang), and ports come from outside the ephemeral range."""

from __future__ import annotations

import ktlite as kt
from ktlite.backends.local import _PORT_RANGE, _master_port


def test_master_port_avoids_taken_ranges_and_ephemeral_ports() -> None:
    taken = set(range(_PORT_RANGE[0], _PORT_RANGE[1] - 100))
    for _ in range(20):
        port = _master_port(taken, 4)
        assert port >= _PORT_RANGE[1] - 100 and port + 4 <= _PORT_RANGE[1] < 32768


def rank_port() -> str:
    import os

    return os.environ["MASTER_PORT"]


def test_live_deployments_get_distinct_master_ports() -> None:
    compute = kt.Compute(cpus=1, stream_logs=False).distribute("pytorch", workers=1, num_proc=1)
    remotes = [kt.fn(rank_port, name=f"ports-{i}").to(compute) for i in range(3)]
    try:
        ports = [r()[0] for r in remotes]
        assert len(set(ports)) == 3
        # a redeploy keeps its port
        assert kt.fn(rank_port, name="ports-0").to(compute)()[0] == ports[0]
    finally:
        for r in remotes:
            r.teardown()
