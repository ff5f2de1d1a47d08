"""A running deployment, found by name from the command line: ``ktlite status`` (and
Kubetorch's ``check`` / ``describe``), and the attach that ``ktlite call`` and
``ktlite logs --rank`` use too. The CLI has no Compute: the pods tell their layout."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from typing import Any

from ktlite.backends.base import Backend
from ktlite.backends.registry import get_backend
from ktlite.errors import ConfigError, KtliteError, NotDeployedError


def named_backend(args: argparse.Namespace) -> Backend:
    return get_backend(args.backend, getattr(args, "namespace", None))


def attach(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """The running deployment NAME (as a Deployment) and its pods' status."""
    from ktlite.api.compute import Compute
    from ktlite.modes.deploy import Deployment
    from ktlite.net.client import PodClient
    from ktlite.specs.deployment_spec import DeploymentSpec

    backend = named_backend(args)
    applied = backend.lookup(args.name)
    if applied is None:
        raise NotDeployedError(
            f"no deployment {args.name!r} on backend {backend.name!r}; "
            "`ktlite list` shows what runs"
        )
    if applied.autoscale is not None:  # replicas, each a world of one (and maybe none now)
        from ktlite.specs.autoscaling import AutoscaleConfig

        served = Compute(backend=backend.name, autoscaling=AutoscaleConfig(**applied.autoscale))
        dep = Deployment(DeploymentSpec(args.name, served.pod_spec()), backend, applied)
        return dep, _pods_status(dep, None)
    # the layout (ranks per pod) is the pods' to tell: the CLI has no Compute
    status = PodClient(applied.token, http=applied.http).status(applied.endpoints[0].url)
    procs = max(1, len(status["ranks"]))
    compute = Compute(backend=backend.name).distribute(
        "spmd", workers=len(applied.endpoints), num_proc=procs
    )
    dep = Deployment(DeploymentSpec(args.name, compute.pod_spec()), backend, applied)
    if len(dep.endpoints) == 1:
        return dep, [status]
    return dep, _pods_status(dep, None)


def _pods_status(dep: Any, stuck_after: float | None) -> list[dict[str, Any]]:
    """Each pod's status: asked of pod 0, which gathers the others' (``modes.podtable``), else
    of each pod at once; a pod that does not answer is an entry saying so (``error``), so the
    others still show."""
    from ktlite.modes import podtable

    eps = dep.endpoints
    if not eps:
        return []
    header = dep.mode.table_relay(podtable.STATUS_S)
    if header is not None:
        try:
            table: list[dict[str, Any]] = dep.client.status(
                eps[0].url, stuck_after, relay=header, timeout=podtable.STATUS_S + podtable.SLACK_S
            )
            return table
        except KtliteError:
            pass  # pod 0 did not answer: ask each pod, so the others still show

    def one(ep: Any) -> dict[str, Any]:
        try:
            return dict(dep.client.status(ep.url, stuck_after))
        except KtliteError as e:
            return {"pod": ep.name, "ordinal": ep.ordinal, "error": str(e), "ranks": []}

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(eps))) as pool:
        return list(pool.map(one, eps))


def status_command(args: argparse.Namespace) -> int:
    from ktlite.modes import status

    if args.watch is not None and not args.watch > 0:
        raise ConfigError(
            f"--watch {args.watch:g}: give the seconds between refreshes, > 0 (e.g. --watch 2)"
        )
    dep, pods = attach(args)
    if args.stuck_after is not None:
        pods = _pods_status(dep, args.stuck_after)
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
            pods = _pods_status(dep, args.stuck_after)  # a pod restarting shows as not answering
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
        pods = _pods_status(dep, args.stuck_after)
