"""``ktlite dashboard``: serve the dashboard (:mod:`ktlite.dashboard`) on 127.0.0.1 until
Ctrl-C, print its address (with the run's secret) and open it in a browser."""

from __future__ import annotations

import argparse
import webbrowser
from typing import Any

from ktlite.backends.registry import NAMES


def dashboard(args: argparse.Namespace) -> int:
    from ktlite.dashboard.serve import Dashboard

    shown = [args.backend] if args.backend else list(NAMES)
    board = Dashboard(port=args.port, backends=shown, namespace=args.namespace).start()
    print(f"ktlite dashboard: {board.url}", flush=True)
    print("(the address holds this run's secret: share it only as you would the deployments)")
    print("Ctrl-C stops it", flush=True)
    if not args.no_browser:
        webbrowser.open(board.url)
    try:
        board.wait()
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
    return 0


def add_command(command: Any) -> None:
    """``ktlite dashboard``'s parser, through the CLI's ``command`` helper."""
    db = command(
        "dashboard",
        "a local web page of every deployment: ranks, usage, live logs, calls, teardown",
        "ktlite dashboard   |   ktlite dashboard --port 8265 --no-browser",
        dashboard,
    )
    db.add_argument(
        "--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)"
    )
    db.add_argument(
        "--no-browser", action="store_true", help="print the address; do not open a browser"
    )
    db.add_argument(
        "--backend",
        default=None,
        choices=NAMES,
        help="show only this backend (default: every backend, each listed or why not)",
    )
    db.add_argument("--namespace", "-n", default=None, help="Kubernetes namespace")
