"""The call plan: the ``x-ktlite-call`` header of ``POST /call`` (JSON), saying who runs a
call and how. Decoding validates every field: a bad header is the caller's fault (400),
never a crash on the pod.
"""

from __future__ import annotations

import math
from typing import Any

from ktlite_wire import envelope, rankdata


class CallPlan:
    """The ``x-ktlite-call`` header: who runs the call and how."""

    def __init__(self, meta: Any) -> None:
        """Validate every field: a bad header is the caller's fault (400), never a crash."""
        if not isinstance(meta, dict):
            raise ValueError("the call plan must be a JSON object")
        self.id = _str(meta, "id", required=True)
        self.pods: list[str] = _list(meta, "pods", str)
        self.names: list[str] = _list(meta, "names", str)
        workers = meta.get("workers")
        self.workers: list[int] | None = None if workers is None else _list(meta, "workers", int)
        if self.workers is not None and (
            not self.workers or not 0 <= min(self.workers) <= max(self.workers) < len(self.pods)
        ):
            raise ValueError(
                f"workers={workers!r} must be pod indices between 0 and {len(self.pods) - 1}"
            )
        self.timeout = _number(meta, "timeout", None)
        self.stream_logs = bool(meta.get("stream_logs", True))
        self.restart = bool(meta.get("restart", False))
        self.fanout = bool(meta.get("fanout", False))
        if self.fanout and not self.pods:
            raise ValueError("a fan-out call needs its pods")
        if self.names and len(self.names) != len(self.pods):
            raise ValueError("names and pods differ in length")
        self.quorum_timeout = _number(meta, "quorum_timeout", 300.0) or 300.0
        num_proc = meta.get("num_proc") or 1
        sizes = num_proc if isinstance(num_proc, list) else [num_proc] * max(1, len(self.pods))
        if not sizes or not _all_of(sizes, int) or not 1 <= min(sizes) <= max(sizes) <= 4096:
            raise ValueError(
                f"num_proc={num_proc!r} must be a whole number between 1 and 4096, or one per pod"
            )
        if isinstance(num_proc, list) and self.pods and len(num_proc) != len(self.pods):
            raise ValueError(f"num_proc has {len(num_proc)} entries for {len(self.pods)} pods")
        self.num_proc = num_proc
        self.sizes: list[int] = sizes  # ranks of each pod
        self.launch_id = _str(meta, "launch_id")  # the code the caller deployed
        # same-host mode (local backend): arguments arrive, and results leave, as files
        shm_arg = meta.get("shm")
        if shm_arg is not None and not (isinstance(shm_arg, list) and len(shm_arg) == 2):
            raise ValueError("shm must be [path, size]")
        self.shm: list[Any] | None = shm_arg
        self.shm_results = bool(meta.get("shm_results", False))
        # seconds a call waits for its caller to re-attach after the stream broke (callers
        # behind a proxy ask for it); 0: a closed stream cancels the call at once
        self.reattach = min(_number(meta, "reattach", 0.0) or 0.0, 120.0)
        ranks = meta.get("ranks")
        self.ranks: list[int] | None = None if ranks is None else _list(meta, "ranks", int)
        # the process-group generation, set by pod 0 (members get it in their plan)
        generation = meta.get("generation")
        if generation is not None and (
            isinstance(generation, bool) or not isinstance(generation, int) or generation < 0
        ):
            raise ValueError(f"generation={generation!r} must be a whole number")
        self.generation: int | None = generation
        group_port = meta.get(
            "group_port"
        )  # its MASTER_PORT, picked by pod 0 (None: the first one)
        if group_port is not None and (
            isinstance(group_port, bool)
            or not isinstance(group_port, int)
            or not 0 < group_port < 65536
        ):
            raise ValueError(f"group_port={group_port!r} must be a TCP port")
        self.group_port: int | None = group_port
        # a per-rank call: the body is the shared message, then each rank's items
        per_rank = meta.get("per_rank")
        self.per_rank: dict[str, Any] | None = (
            None if per_rank is None else rankdata.check_plan(per_rank)
        )

    def name(self, i: int) -> str:
        """Pod ``i``'s name (its URL when the caller sent no names)."""
        return self.names[i] if self.names else self.pods[i]

    def pod_ranks(self, i: int) -> range:
        """The global ranks of pod ``i``."""
        start = sum(self.sizes[:i])
        return range(start, start + self.sizes[i])

    def member_meta(self, per_rank: dict[str, Any] | None = None) -> dict[str, Any]:
        meta = {
            "id": self.id,
            "stream_logs": self.stream_logs,
            "restart": self.restart,
            "fanout": False,
            "shm": self.shm,
            "shm_results": self.shm_results,
            "launch_id": self.launch_id,
            "num_proc": self.num_proc,
            "generation": self.generation,
            "group_port": self.group_port,
            "ranks": self.ranks,
        }
        if per_rank is not None:
            meta["per_rank"] = per_rank
        return meta

    def member_body(self, i: int, payload: Any) -> tuple[dict[str, Any], Any]:
        """What pod ``i`` is sent: the call plan and body, a per-rank call's cut to the shared
        message and that pod's own items (from shared memory: just their offsets)."""
        if self.per_rank is None:
            return self.member_meta(), memoryview(b"" if self.shm else payload).cast("B")
        ranks = self.pod_ranks(i)
        slices = rankdata.pod_slices(self.per_rank, ranks)
        shared = self.per_rank["shared"]
        if self.shm:  # every pod maps the same file: offsets only
            return self.member_meta(
                {"shared": shared, "items": slices, "base": ranks.start}
            ), memoryview(b"")
        view = memoryview(payload).cast("B")
        body, items, pos = [view[:shared]], [], shared
        for off, n in slices:
            body.append(view[off : off + n])
            items.append([pos, n])
            pos += n
        return self.member_meta({"shared": shared, "items": items, "base": ranks.start}), body


def _str(meta: dict[str, Any], key: str, required: bool = False) -> str:
    value = meta.get(key)
    if value in (None, "") and not required:
        return ""
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(
            f"{key} must be a {'non-empty ' if required else ''}string of at most 200 characters"
        )
    return value


def _all_of(values: list[Any], kind: type) -> bool:
    """Every value is exactly a ``kind`` (a bool is not an int). A loop, not all() over a
    generator: a plan is checked on every call, and its lists grow with the pods."""
    for v in values:  # noqa: SIM110 - see above
        if type(v) is not kind:
            return False
    return True


def _list(meta: dict[str, Any], key: str, kind: type) -> list[Any]:
    value = meta.get(key) or []
    if type(value) is not list or not _all_of(value, kind):
        raise ValueError(f"{key} must be a list of {kind.__name__}")
    return value


def _number(meta: dict[str, Any], key: str, default: float | None) -> float | None:
    value = meta.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{key}={value!r} must be a positive number of seconds")
    return float(value)


def decode_plan(header: str) -> CallPlan:
    """The plan from its header's text. Raises ValueError (also for JSON that is not one)."""
    try:
        meta = envelope.loads_json(header)
    except RecursionError:
        raise ValueError("the call plan nests too deeply") from None
    return CallPlan(meta)
