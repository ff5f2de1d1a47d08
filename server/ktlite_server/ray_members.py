"""The members of a pod's Ray cluster, as the head's pod server knows them.

The GCS is asked in a subprocess (``ktlite_server.ray_probe``): the pod server never imports
Ray. The pods' servers say whether their node failed (``engine_failed`` in ``/health``): the
head stops waiting for a node that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

import httpx

from ktlite_server.engine import EngineError, env_without_token

PROBE_TIMEOUT_S = 15.0  # beyond its own wait, for the probe to import Ray and answer


def auth_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment of every process that talks to the node's cluster: Ray's token mode with
    the deployment's Ray token, or explicitly none (a ~/.ray/auth_token left by some other
    ray.init() on this machine must not switch one node on and leave another off)."""
    token = cfg.get("auth_token")
    return (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        if token
        else {"RAY_AUTH_MODE": "disabled"}
    )


def missing_nodes(
    expected: list[dict[str, Any]], found: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The expected Ray nodes (``{"pod", "ip", "port"}``) the GCS does not list alive. Nodes
    of one host (the local backend; a head alone there too) are told apart by port alone: Ray
    reports a node given 127.0.0.1 by the host's own address, and every pod's node has ports
    of its own."""
    one_host = len({e["ip"] for e in expected}) == 1
    alive = {n["port"] if one_host else (n["ip"], n["port"]) for n in found if n["alive"]}
    return [e for e in expected if (e["port"] if one_host else (e["ip"], e["port"])) not in alive]


async def nodes(cfg: dict[str, Any], want: int, timeout: float) -> list[dict[str, Any]]:
    """The nodes of ``cfg``'s cluster as its GCS lists them, once ``want`` are alive or
    ``timeout`` ran out (``want`` 0: at once). Cancelled, it kills its probe."""
    address = cfg["address"]
    env = env_without_token()
    env.update(auth_env(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ktlite_server.ray_probe",
        address,
        str(want),
        str(timeout),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout + PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise EngineError(
            f"asking the Ray GCS at {address} for its nodes took over "
            f"{timeout + PROBE_TIMEOUT_S:.0f}s"
        ) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
    if proc.returncode != 0:
        raise EngineError(
            f"asking the Ray GCS at {address} for its nodes failed: "
            f"{err.decode(errors='replace').strip()[-2000:]}"
        )
    return list(json.loads(out)["nodes"])


async def engine_failed(client: httpx.AsyncClient, url: str, launch_id: str) -> str | None:
    """Why the pod server at ``url`` (its ``/health``) could not start its engine for this
    launch, or None (it has not failed, or does not answer)."""
    try:
        failed = (await client.get(url)).json().get("engine_failed")
    except (httpx.HTTPError, ValueError):
        return None
    if failed and failed.get("launch_id") == launch_id:
        return str(failed.get("message"))
    return None


async def failed_members(
    client: httpx.AsyncClient, expected: list[dict[str, Any]], launch_id: str
) -> list[tuple[str, str]]:
    """``(pod, why)`` for each expected node whose pod server says its node failed."""
    asking = [e for e in expected if e.get("health")]
    answers = await asyncio.gather(*(engine_failed(client, e["health"], launch_id) for e in asking))
    return [(e["pod"], why) for e, why in zip(asking, answers, strict=True) if why]
