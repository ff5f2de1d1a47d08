"""``ktlite port-forward NAME [LOCAL:]PORT``: a port inside a deployment's pod, here.

What the pod serves on ``PORT`` (a ``kt.app(port=...)`` command, TensorBoard, a notebook)
answers on ``http://127.0.0.1:LOCAL`` until Ctrl-C, through the pod's server and the
deployment token (:mod:`ktlite.net.portforward`): on every backend, Kubernetes included
(through the API server's pod proxy, with no ``kubectl``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
from typing import Any

from ktlite.errors import ConfigError, NotDeployedError


def _ports(text: str) -> tuple[int, int]:
    local, _, remote = text.rpartition(":")
    try:
        ports = (int(local) if local else int(remote), int(remote))
    except ValueError:
        raise ConfigError(f"{text!r}: give PORT or LOCAL:PORT, e.g. 8000 or 9000:8000") from None
    if not (0 <= ports[0] <= 65535 and 1 <= ports[1] <= 65535):
        raise ConfigError(f"{text!r}: ports are 1-65535 (LOCAL may be 0: any free port)")
    return ports


def forward(args: argparse.Namespace) -> tuple[Any, str]:
    """A started :class:`~ktlite.net.portforward.PortForward` to ``args.ports`` of pod
    ``args.replica`` of deployment ``args.name``, and that pod's name."""
    from ktlite.commands.status_cli import named_backend
    from ktlite.net import tls
    from ktlite.net.portforward import PortForward

    local, remote = _ports(args.ports)
    backend = named_backend(args)
    applied = backend.lookup(args.name)
    if applied is None:
        raise NotDeployedError(
            f"no deployment {args.name!r} on backend {backend.name!r}; `ktlite list` shows what runs"
        )
    if not 0 <= args.replica < len(applied.endpoints):
        raise ConfigError(
            f"--replica {args.replica}: {args.name!r} has {len(applied.endpoints)} pod(s)"
        )
    endpoint = applied.endpoints[args.replica]
    started = PortForward(
        endpoint.url,
        remote,
        applied.token,
        http=applied.http,
        pinned=functools.partial(tls.pinned_context, applied.token),
        local_port=local,
    )
    started.start()
    return started, endpoint.name


def port_forward(args: argparse.Namespace) -> int:
    started, pod = forward(args)
    print(
        f"forwarding {started.url} -> port {started.port} of pod {pod} (Ctrl-C stops)", flush=True
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        print("", file=sys.stderr)
    finally:
        started.close()
    return 0


def add_command(command: Any, where: Any) -> None:
    """``ktlite port-forward``'s parser, through the CLI's ``command`` and ``where`` helpers."""
    pf = command(
        "port-forward",
        "reach a port inside a deployment's pod at a local URL (a kt.app(port=...) server, "
        "TensorBoard, a notebook), through its pod server",
        "ktlite port-forward web 8000   |   ktlite port-forward train 6006:6006 --replica 1",
        port_forward,
    )
    pf.add_argument("name")
    pf.add_argument("ports", metavar="[LOCAL:]PORT", help="the pod's port; LOCAL: here (0: any)")
    pf.add_argument("--replica", type=int, default=0, help="which pod (default 0)")
    where(pf)
