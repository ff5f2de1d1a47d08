"""One pod's server process: its arguments, token, TLS and lifetime (``python -m ktlite_server``
runs :func:`main`).

The deployment token is read from a file (``--token-file``, default ``KTLITE_TOKEN_FILE``;
on Kubernetes a Secret volume), from stdin's first line (``--token-stdin``, the local and SSH
backends), or, for a server started by hand, from ``KTLITE_TOKEN``; never from argv, which
``ps`` shows. A file or stdin keeps it out of ``/proc/<pid>/environ``, which the rank
processes (user code, the same user) could read: an environment variable stays there even
once removed.
With ``--ready-file`` the bound port is written there once the server accepts requests.
With ``--tls-stdin`` or ``--tls-cert-file``/``--tls-key-file`` it serves only TLS, and pins
that certificate in its requests to the other pods (:mod:`ktlite_server.tls`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from ktlite_server import logconfig, tls
from ktlite_server.app import create_app
from ktlite_server.connections import Limits, guarded
from ktlite_server.inactivity import Inactivity
from ktlite_server.pod import Pod
from ktlite_server.selfteardown import PATHS_ENV, SelfTeardown
from ktlite_wire import keepbudget, privatefiles

logger = logging.getLogger(__name__)


def _ordinal() -> int:
    """KTLITE_POD_ORDINAL, else the StatefulSet ordinal at the end of the pod name, else 0."""
    value = os.environ.get("KTLITE_POD_ORDINAL", "")
    if value.isdigit():
        return int(value)
    tail = (os.environ.get("KTLITE_POD_NAME") or socket.gethostname()).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ktlite_server", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=32300)
    p.add_argument("--pod", default=os.environ.get("KTLITE_POD_NAME") or socket.gethostname())
    p.add_argument("--ordinal", type=int, default=_ordinal())
    p.add_argument(
        "--procs", type=int, default=1, help="rank processes to start before code arrives"
    )
    p.add_argument("--ready-file", default=None)
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument(
        "--token-stdin", action="store_true", help="read the token from stdin's first line"
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("KTLITE_TOKEN_FILE") or None,
        help="read the token from this file (default: $KTLITE_TOKEN_FILE)",
    )
    p.add_argument(
        "--inactivity-ttl",
        type=float,
        default=float(os.environ.get("KTLITE_INACTIVITY_TTL") or 0) or None,
        help="after this many seconds without a call: exit (on Kubernetes: pod 0 deletes the "
        "deployment; default: $KTLITE_INACTIVITY_TTL)",
    )
    p.add_argument(
        "--tether-stdin",
        action="store_true",
        help="exit when stdin closes (the SSH channel that started this server is gone)",
    )
    tls.add_arguments(p)
    return p.parse_args()


def _token(args: argparse.Namespace) -> str:
    """The deployment token: from stdin when asked (a local or SSH server), else from the
    token file, else from ``KTLITE_TOKEN``. Neither variable is left for the rank processes
    to inherit: a rank that starts a deployment of its own (a local one, whose server reads
    stdin) must not hand its server this pod's token file."""
    token = os.environ.pop("KTLITE_TOKEN", "")
    os.environ.pop("KTLITE_TOKEN_FILE", None)
    if args.token_stdin:  # kept out of /proc/<pid>/environ, which env is not
        token = sys.stdin.readline().strip()
    elif args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise SystemExit(
                f"ktlite_server: cannot read the deployment token from {args.token_file}: "
                f"{e.strerror} (uid {os.getuid()}, groups {os.getgroups()}); on Kubernetes the "
                "pod's fsGroup must give its user read access to the token Secret's file"
            ) from None
        if not token:
            raise SystemExit(f"ktlite_server: the token file {args.token_file} is empty")
    if not token:
        raise SystemExit(
            "ktlite_server: no deployment token (--token-file, KTLITE_TOKEN_FILE, --token-stdin "
            "or KTLITE_TOKEN): the server refuses to run without one"
        )
    return token


def _stop(server: uvicorn.Server, pod: Pod) -> None:
    for rank in pod.ranks:  # stop running calls now; shutdown would wait for them
        if rank is not None:
            rank.kill()
    server.should_exit = True


def _watch_stdin(loop: asyncio.AbstractEventLoop, server: uvicorn.Server, pod: Pod) -> None:
    """In a thread: block on stdin until it closes, then stop the server."""
    with contextlib.suppress(OSError, ValueError):
        while sys.stdin.buffer.read(4096):
            pass
    with contextlib.suppress(RuntimeError):  # the loop already closed: the server is gone
        loop.call_soon_threadsafe(_stop, server, pod)


async def _watch_parent(pid: int, server: uvicorn.Server, pod: Pod) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            os.kill(pid, 0)
            alive = os.getppid() == pid
        except ProcessLookupError:
            alive = False
        if not alive:
            _stop(server, pod)
            return


def main() -> None:
    args = _parse()
    logconfig.configure()  # KTLITE_LOG_LEVEL, handed over by the client
    token = _token(args)
    served_tls = tls.load(args)  # after the token: stdin's second line
    if os.environ.get("KTLITE_STORE_ROOT"):  # the namespace's data store pod (kt.put/get)
        from ktlite_server.store import serve

        root = os.environ["KTLITE_STORE_ROOT"]
        if os.path.isdir(root) and not os.access(root, os.W_OK):
            raise SystemExit(
                f"ktlite_server: the store's volume {root} is not writable by this pod's user "
                f"(uid {os.getuid()}, groups {os.getgroups()}): its StorageClass ignores the "
                "pod's fsGroup (hostPath and some NFS provisioners do); create the store with "
                "KTLITE_STORE_RUN_AS_USER=0 set, or use a StorageClass that applies fsGroup"
            )

        serve(root, token, args.host, args.port, args.ready_file)
        return
    try:
        limits = Limits.from_env()
    except ValueError as e:
        raise SystemExit(f"ktlite_server: {e}") from None
    try:  # before the ranks start: they keep their files within the same budget
        keepbudget.open_for_pod()
    except ValueError as e:  # KTLITE_RECEIVE_KEEP_MB that is not a number
        raise SystemExit(f"ktlite_server: {e}") from None
    except OSError as e:  # no room in /dev/shm for 4 KiB: each process keeps within its own
        logger.warning("no keep ledger for this pod (%r): each process keeps its own files", e)
    pod = Pod(args.pod, args.ordinal, procs=args.procs)
    app = logconfig.request_log(
        create_app(pod, token, limits=limits, peer_tls=served_tls.peers if served_tls else None)
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level=os.environ.get("KTLITE_SERVER_LOG_LEVEL", "warning"),
        access_log=False,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        # httptools, with bounded request heads, a header timeout and a connection cap
        http=guarded(limits),
        timeout_keep_alive=limits.idle_timeout,  # type: ignore[arg-type]
        # a stream of a call that is still running must not hold shutdown (SIGTERM) forever
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    if served_tls is not None:  # our own context: uvicorn's takes files, the key's is gone
        config.load()
        config.ssl = served_tls.server
        logger.info("serving TLS, certificate SHA-256 %s", served_tls.fingerprint)
    server = uvicorn.Server(config)
    inactivity = None
    # read (default of --inactivity-ttl, SelfTeardown.from_env), and not handed to the ranks: a
    # deployment a rank starts (a local one) is not this one and has no TTL of its own
    os.environ.pop("KTLITE_INACTIVITY_TTL", None)
    if args.inactivity_ttl:
        pod.inactivity_ttl = args.inactivity_ttl
        kubernetes = os.environ.get("KTLITE_BACKEND") == "kubernetes"
        inactivity = Inactivity(
            args.inactivity_ttl,
            pod,
            lambda: _stop(server, pod),
            kubernetes=kubernetes,
            teardown=SelfTeardown.from_env() if kubernetes else None,
        )
    os.environ.pop(PATHS_ENV, None)

    async def run_server() -> None:
        loop = asyncio.get_running_loop()
        if args.parent_pid:
            loop.create_task(_watch_parent(args.parent_pid, server, pod))
        if inactivity is not None:
            loop.create_task(inactivity.watch())
        if args.tether_stdin:
            threading.Thread(target=_watch_stdin, args=(loop, server, pod), daemon=True).start()
        serving = loop.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if server.started and args.ready_file:
            privatefiles.write_file(args.ready_file, json.dumps({"port": port, "pid": os.getpid()}))
        await serving
        if inactivity is not None and inactivity.tearing_down is not None:
            await inactivity.tearing_down  # SIGTERM came as its deletes ran: let them finish

    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
        if config.loop == "uvloop":
            import uvloop

            uvloop.run(run_server())
        else:
            asyncio.run(run_server())
