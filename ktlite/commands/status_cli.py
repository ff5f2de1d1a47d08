"""A running deployment, found by name from the command line: ``ktlite status`` (and
Kubetorch's ``check`` / ``describe``), and the attach that ``ktlite call`` and
``ktlite logs --rank`` use too. The CLI has no Compute: the pods tell their layout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ktlite.api.attach import attach as attached
from ktlite.api.attach import pods_status
from ktlite.backends.base import Backend
from ktlite.backends.registry import get_backend
from ktlite.errors import ConfigError


def named_backend(args: argparse.Namespace) -> Backend:
    return get_backend(args.backend, getattr(args, "namespace", None))


def attach(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """The running deployment NAME (as a Deployment) and its pods' status."""
    return attached(named_backend(args), args.name)


def status_command(args: argparse.Namespace) -> int:
    from ktlite.modes import status

    if args.watch is not None and not args.watch > 0:
        raise ConfigError(
            f"--watch {args.watch:g}: give the seconds between refreshes, > 0 (e.g. --watch 2)"
        )
    dep, pods = attach(args)
    if args.stuck_after is not None:
        pods = pods_status(dep, args.stuck_after)
    if dep.applied.autoscale is not None:
        return _serving_status(args, dep, pods)
    if args.watch is None:
        print(json.dumps(pods, indent=2) if args.json else status.table(args.name, pods))
        if status.stuck_ranks(pods):
            return 2
        return 1 if any("error" in p for p in pods) else 0
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            if args.json:
                print(json.dumps(pods), flush=True)
            else:
                stamp = time.strftime("%H:%M:%S")
                frame = f"{stamp}  every {args.watch:g}s, Ctrl-C to stop\n{status.table(args.name, pods)}"
                print(("\x1b[H\x1b[J" if clear else "\n") + frame, flush=True)
            time.sleep(args.watch)
            pods = pods_status(dep, args.stuck_after)  # a pod restarting shows as not answering
    except KeyboardInterrupt:
        return 0


def _serving_status(args: argparse.Namespace, dep: Any, pods: list[dict[str, Any]]) -> int:
    """`ktlite status` of an autoscaled deployment: replicas, calls in flight, the autoscaler."""
    from ktlite.modes import status

    while True:
        scaling = dep.backend.scaling_status(args.name)
        if args.json:
            print(
                json.dumps(
                    {"replicas": pods, "autoscale": dep.applied.autoscale, "autoscaler": scaling},
                    indent=None if args.watch else 2,
                    default=str,
                ),
                flush=True,
            )
        else:
            text = status.serving(args.name, dep.applied.autoscale, scaling, pods)
            if pods:
                text += "\n" + status.table(args.name, pods)
            print(
                text if args.watch is None else f"\n{time.strftime('%H:%M:%S')}\n{text}", flush=True
            )
        if args.watch is None:
            return 1 if any("error" in p for p in pods) else 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        applied = dep.backend.lookup(args.name)
        if applied is None:
            print(f"{args.name}: torn down")
            return 1
        dep.applied = applied
        pods = pods_status(dep, args.stuck_after)
