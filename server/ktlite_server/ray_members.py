"""The members of a pod's Ray cluster, as the head's pod server knows them.

The GCS is asked in a subprocess (``ktlite_server.ray_probe``): the pod server never imports
Ray. That probe imports Ray first, which takes seconds on a busy machine, so ``status()``
never waits for one: :class:`Members` answers from the last list the GCS gave (with its
time), and refreshes it in the background. The pods' servers say whether their node failed
(``engine_failed`` in ``/health``): the head stops waiting for a node that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from typing import Any

from ktlite_server.engine import EngineError, env_without_token
from ktlite_server.peers import PeerError, PeerPool

PROBE_TIMEOUT_S = 15.0  # beyond its own wait, for the probe to import Ray and answer
FRESH_S = 2.0  # a list younger than this is not asked again
STATUS_WAIT_S = 1.0  # how long status() waits for a fresh list before it answers the last one


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


async def engine_failed(
    peers: PeerPool, url: str, launch_id: str, timeout: float = 1.0
) -> str | None:
    """Why the pod server at ``url`` (its ``/health``, asked with the deployment's token)
    could not start its engine for this launch, or None (it has not failed, or does not answer)."""
    try:
        health = await peers.get_json(url, timeout)
        failed = health.get("engine_failed") if isinstance(health, dict) else None
    except PeerError:
        return None
    if failed and failed.get("launch_id") == launch_id:
        return str(failed.get("message"))
    return None


async def failed_members(
    peers: PeerPool, expected: list[dict[str, Any]], launch_id: str
) -> list[tuple[str, str]]:
    """``(pod, why)`` for each expected node whose pod server says its node failed."""
    asking = [e for e in expected if e.get("health")]
    answers = await asyncio.gather(*(engine_failed(peers, e["health"], launch_id) for e in asking))
    return [(e["pod"], why) for e, why in zip(asking, answers, strict=True) if why]


class Members:
    """The head's last list of its cluster's nodes, refreshed in the background."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.found: list[dict[str, Any]] | None = None
        self.at: float | None = None  # time.time() of the list
        self.error: str | None = None  # the last probe's failure, if it failed
        self._probe: asyncio.Task[None] | None = None

    def seed(self, found: list[dict[str, Any]]) -> None:
        self.found, self.at, self.error = found, time.time(), None

    async def snapshot(self, wait: float = STATUS_WAIT_S) -> dict[str, Any]:
        """``nodes`` and ``lost`` as of ``nodes_as_of``; ``probe`` is "pending" while a fresher
        list is being asked for (at most ``wait`` seconds are spent waiting for it here)."""
        if self._probe is None and (self.at is None or time.time() - self.at >= FRESH_S):
            self._probe = asyncio.get_running_loop().create_task(self._refresh())
        if self._probe is not None:
            await asyncio.wait(
                [self._probe], timeout=wait
            )  # never cancels it: the next status gets it
        out: dict[str, Any] = {
            "nodes_as_of": self.at,
            "probe": "pending" if self._probe is not None else "done",
        }
        if self.found is not None:
            out["nodes"] = self.found
            out["lost"] = [e["pod"] for e in missing_nodes(self.cfg["expected"], self.found)]
        if self.error is not None:
            out["error"] = self.error
        return out

    async def _refresh(self) -> None:
        try:
            self.seed(await nodes(self.cfg, 0, 0))
        except EngineError as e:
            self.error = str(e)
        finally:
            self._probe = None

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
