"""The recent calls of a deployment, from its pods' status (each pod's ``recent_calls``,
:mod:`ktlite_server.callhistory`): one entry per call with every rank's span, how it ended,
and a failed rank's exception (type, message, traceback).

A rank's span starts when the call reached its pod and ends when its outcome was known
there. ``reach_s`` is how long the call took to reach the pod after it reached the first pod
(the coordinator's fan-out); ``wait_s`` is how long the rank then waited for the slowest rank
of the call to end.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ktlite_wire import codec
from ktlite_wire.errors import ProtocolError, RemoteExceptionInfo

MAX_CALLS = 20  # the newest calls shown


def error_of(encoded: str | None) -> dict[str, str] | None:
    """A failed rank's exception from its encoded info (what the rank raised, as the caller
    decodes a call's error: only the info object, never the exception's own pickle)."""
    if encoded is None:
        return None
    try:
        info = codec.loads(base64.b64decode(encoded, validate=True))
    except (binascii.Error, ProtocolError, ValueError, EOFError) as e:
        return {"type": "undecodable", "message": f"the rank's error could not be read: {e}"}
    except Exception as e:  # noqa: BLE001 - a pickle of a class this process lacks, and the like
        return {
            "type": "undecodable",
            "message": f"the rank's error could not be read: {type(e).__name__}: {e}",
        }
    if not isinstance(info, RemoteExceptionInfo):
        return {"type": "undecodable", "message": f"not an exception's info: {type(info).__name__}"}
    kind = info.type_name.removeprefix("builtins.")
    return {"type": kind, "message": info.message, "traceback": info.traceback}


def calls(pods: list[dict[str, Any]], limit: int = MAX_CALLS) -> list[dict[str, Any]]:
    """The newest ``limit`` calls the pods report, newest first, each with its ranks in rank
    order."""
    merged: dict[str, dict[str, Any]] = {}
    for pod in pods:
        for call in pod.get("recent_calls") or ():
            entry = merged.setdefault(call["id"], {"id": call["id"], "pods": []})
            entry["pods"].append((pod.get("pod", "?"), call))
    out = [_call(entry) for entry in merged.values()]
    out.sort(key=lambda c: c["start"], reverse=True)
    return out[:limit]


def _call(entry: dict[str, Any]) -> dict[str, Any]:
    start = min(call["start"] for _, call in entry["pods"])
    end = max(call["end"] for _, call in entry["pods"])
    ranks = []
    for pod, call in entry["pods"]:
        for r in call["ranks"]:
            rank_end = min(max(r["end"], call["start"]), end)
            ranks.append(
                {
                    "rank": r["rank"],
                    "pod": pod,
                    "status": r["status"],
                    "start": call["start"],
                    "end": rank_end,
                    "reach_s": round(call["start"] - start, 6),
                    "run_s": round(rank_end - call["start"], 6),
                    "wait_s": round(end - rank_end, 6),
                    "message": r.get("message") or "",
                    "error": error_of(r.get("error")),
                    "error_dropped": bool(r.get("error_dropped")),
                }
            )
    ranks.sort(key=lambda r: r["rank"])
    failed = [r["rank"] for r in ranks if r["status"] != "ok"]
    return {
        "id": entry["id"],
        "start": start,
        "end": end,
        "duration_s": round(end - start, 6),
        "status": "ok" if not failed else "failed",
        "failed_ranks": failed,
        "ranks": ranks,
    }
