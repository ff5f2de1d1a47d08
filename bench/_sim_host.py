"""One process holding many simulated pods for ``bench_scale.py``: each pod is the real
pod server (``ktlite_server``'s app, admission gate, connection guard, coordinator, peers,
call plans, streams, launches) on its own listening socket, over the real pod runtime
(``Pod``), whose ranks are in-process stand-ins (``_sim_rank.SimRank``).

    python bench/_sim_host.py --name NAME --first 0 --count 250 --procs 8 --ready-file F

The token is stdin's first line (as ``ktlite_server --token-stdin``). Then stdin takes
commands, one a line: ``kill <ordinal>`` makes that pod die as a killed process would (its
connections reset, its socket closed, its ranks gone); ``profile on`` starts cProfile on the
servers' event loop, ``profile <path>`` stops it and writes its stats to ``path`` (written
whole under another name, then renamed); ``timeline on`` records, for each call this host's
pods coordinate or relay, when each child's answer arrived and when the probes of its children
before the call (``Coordinator._quorum``) began and answered (the monotonic clock, which every
process of the machine shares, and the loop thread's CPU time then), ``timeline <path>``
writes those records to ``path`` (JSON, the same way) and stops. The process exits when stdin
closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _sim_rank import SimPod  # noqa: E402

from ktlite_server.app import create_app  # noqa: E402
from ktlite_server.connections import Limits, guarded  # noqa: E402
from ktlite_server.coordinator import Coordinator  # noqa: E402
from ktlite_server.peers import PeerPool  # noqa: E402
from ktlite_wire import privatefiles  # noqa: E402

logger = logging.getLogger("bench.sim_host")


class SimServer:
    """One simulated pod: its server's listener and connections, and its pod runtime."""

    def __init__(self, pod: SimPod, token: str) -> None:
        self.pod = pod
        limits = Limits()
        self.config = uvicorn.Config(
            create_app(pod, token, limits=limits),
            http=guarded(limits),
            lifespan="off",
            access_log=False,
            log_level="warning",
            proxy_headers=False,
            timeout_keep_alive=int(limits.idle_timeout),
        )
        self.config.load()
        self.state = ServerState()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        loop = asyncio.get_running_loop()

        def protocol() -> Any:
            return self.config.http_protocol_class(  # type: ignore[call-arg]
                config=self.config, server_state=self.state, app_state={}
            )

        self.server = await loop.create_server(protocol, sock=sock, backlog=2048)
        await self.pod.prespawn()
        return int(sock.getsockname()[1])

    def kill(self) -> None:
        """Die as a killed process: every connection reset, the listener gone, ranks gone."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.state.connections):
            conn.transport.abort()  # type: ignore[attr-defined]
        for conns in self.pod.peers._idle.values():
            for c in conns:
                c.writer.transport.abort()
        for rank in self.pod.ranks:
            if rank is not None:
                rank.kill()


# (call id, this pod's ordinal, what: "answer" (a child's answer arrived), "probe" (the quorum
# probe of a child answered) or "quorum" (the probes began; child -1), the child's ordinal,
# monotonic s, the loop thread's CPU s)
Arrival = tuple[str, int, str, int, float, float]
_CALL: contextvars.ContextVar[tuple[str, int, dict[str, int]] | None] = contextvars.ContextVar(
    "sim_call", default=None
)


def record_arrivals(into: list[Arrival]) -> Any:
    """Wrap ``Coordinator._remote`` (each child's answer, as the coordinator gets it),
    ``Coordinator._quorum`` and ``PeerPool.ensure`` (the probes of the children before a
    call, when their connections were idle too long) to note when each happened; returns a
    function that puts the originals back. Measuring only: the call runs as it would."""
    real_remote, real_quorum, real_ensure = (
        Coordinator._remote,
        Coordinator._quorum,
        PeerPool.ensure,
    )

    def note(call_id: str, pod: int, what: str, child: int) -> None:
        into.append((call_id, pod, what, child, time.monotonic(), time.thread_time()))

    async def remote(self: Coordinator, plan: Any, i: int, payload: Any, emit: Any) -> Any:
        got = await real_remote(self, plan, i, payload, emit)
        note(plan.id, self.pod.ordinal, "answer", i)
        return got

    async def quorum(self: Coordinator, plan: Any, remote: list[int], emit: Any) -> Any:
        note(plan.id, self.pod.ordinal, "quorum", -1)
        urls = {plan.url(i): i for i in remote}
        token = _CALL.set((plan.id, self.pod.ordinal, urls))  # the probes' tasks inherit it
        try:
            return await real_quorum(self, plan, remote, emit)
        finally:
            _CALL.reset(token)

    async def ensure(self: PeerPool, url: str, *args: Any, **kwargs: Any) -> None:
        await real_ensure(self, url, *args, **kwargs)
        call = _CALL.get()
        if call is not None and url in call[2]:
            note(call[0], call[1], "probe", call[2][url])

    Coordinator._remote = remote  # type: ignore[method-assign]
    Coordinator._quorum = quorum  # type: ignore[method-assign]
    PeerPool.ensure = ensure  # type: ignore[method-assign]

    def restore() -> None:
        Coordinator._remote = real_remote  # type: ignore[method-assign]
        Coordinator._quorum = real_quorum  # type: ignore[method-assign]
        PeerPool.ensure = real_ensure  # type: ignore[method-assign]

    return restore


def write_json(path: str, data: Any) -> None:
    with open(path + ".part", "w") as f:
        json.dump(data, f)
    os.replace(path + ".part", path)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--ready-file", required=True)
    args = p.parse_args()
    token = sys.stdin.readline().strip()
    servers = {
        i: SimServer(SimPod(f"{args.name}-{i}", i, procs=args.procs), token)
        for i in range(args.first, args.first + args.count)
    }
    ports = {i: await s.start() for i, s in servers.items()}
    privatefiles.write_file(args.ready_file, json.dumps({"pid": os.getpid(), "ports": ports}))
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    profilers = [cProfile.Profile(time.thread_time)]  # CPU, not the wall: 2 busy cores

    def dump(path: str) -> None:
        profiler = profilers[-1]
        profiler.disable()
        profiler.dump_stats(path + ".part")
        profilers.append(cProfile.Profile(time.thread_time))  # the next one starts afresh
        os.replace(path + ".part", path)

    arrivals: list[Arrival] = []
    unwrapped: list[Any] = []

    def timeline(arg: str) -> None:
        if arg == "on" and not unwrapped:
            arrivals.clear()
            unwrapped.append(record_arrivals(arrivals))
        elif arg != "on":
            if unwrapped:
                unwrapped.pop()()
            write_json(arg, arrivals)

    def commands() -> None:
        for line in sys.stdin:
            word, _, arg = line.strip().partition(" ")
            if word == "kill" and arg.isdigit() and int(arg) in servers:
                loop.call_soon_threadsafe(servers[int(arg)].kill)
            elif word == "profile" and arg == "on":  # the loop's thread is the one profiled
                loop.call_soon_threadsafe(lambda: profilers[-1].enable())
            elif word == "profile" and arg:
                loop.call_soon_threadsafe(dump, arg)
            elif word == "timeline" and arg:
                loop.call_soon_threadsafe(timeline, arg)
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=commands, daemon=True).start()
    await done.wait()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())  # as the pod server runs
