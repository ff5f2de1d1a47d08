"""The call plan: the ``x-ktlite-call`` header of ``POST /call`` (JSON), saying who runs a
call and how. The caller builds one :class:`CallPlan` and sends :meth:`CallPlan.encode`; the
pod decodes it with :func:`decode_plan`. Both run the same validation: a bad plan is the
caller's fault (a ``ValueError``, answered 400), never a crash on the pod.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from ktlite_wire import envelope, rankdata

# one encoder: json.dumps with any non-default argument builds a new JSONEncoder per call
_COMPACT = json.JSONEncoder(separators=(",", ":"))


@dataclass
class CallPlan:
    """The ``x-ktlite-call`` header: who runs the call and how.

    Mutable on purpose: pod 0 stamps ``generation`` and ``group_port`` on the plan it got
    before it fans the call out.
    """

    id: str
    # the pods' URLs by ordinal, from ordinal ``first_pod`` on: the caller's plan names every
    # pod; a relay's (ktlite_wire.calltree) only the pods of the subtree it coordinates
    pods: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # their names (for errors and logs)
    workers: list[int] | None = None  # only these pods run it (None: all)
    timeout: float | None = None  # the call's limit in seconds (None: none)
    stream_logs: bool = True
    restart: bool = False  # fresh rank processes before the call
    fanout: bool = False  # this pod coordinates: it calls the other pods
    quorum_timeout: float = 300.0  # how long the coordinator waits for every pod
    num_proc: int | list[int] = 1  # ranks per pod: one number, or one per pod
    launch_id: str = ""  # the code the caller deployed ("": whatever runs)
    # same-host mode (local backend): arguments arrive, and results leave, as files
    shm: list[Any] | None = None  # [path, size] of the arguments' file
    shm_results: bool = False
    # seconds a call waits for its caller to re-attach after the stream broke (callers behind
    # a proxy ask for it); 0: a closed stream cancels the call at once. At most 120.
    reattach: float = 0.0
    ranks: list[int] | None = None  # only these global ranks run it
    # a call tree of this fan-out (ktlite_wire.calltree): each pod relays the call to at most
    # this many children; 0: flat, pod 0 calls every pod itself
    tree: int = 0
    first_pod: int = 0  # the ordinal of pods[0]
    first_rank: int = 0  # the global rank of that pod's first rank
    generation: int | None = None  # the process-group generation, set by pod 0
    group_port: int | None = None  # its MASTER_PORT, picked by pod 0 (None: the first one)
    # a per-rank call: the body is the shared message, then each rank's items
    per_rank: dict[str, Any] | None = None
    sizes: list[int] = field(init=False, repr=False, compare=False)  # ranks of each pod
    # the pods' part as header text, kept by a plan made with for_call (shared, not changed)
    _pods_text: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_pods()
        self._check_call()

    def _check_pods(self) -> None:
        """The fields every call of a deployment shares: its pods and their ranks."""
        self.pods = _list("pods", self.pods, str)
        self.names = _list("names", self.names, str)
        if type(self.fanout) is not bool:
            raise ValueError(f"fanout={self.fanout!r} must be true or false")
        if self.fanout and not self.pods:
            raise ValueError("a fan-out call needs its pods")
        if self.names and len(self.names) != len(self.pods):
            raise ValueError("names and pods differ in length")
        self.quorum_timeout = _seconds("quorum_timeout", self.quorum_timeout, 300.0) or 300.0
        num_proc: Any = self.num_proc
        if isinstance(num_proc, tuple):
            num_proc = list(num_proc)
        sizes = num_proc if isinstance(num_proc, list) else [num_proc] * max(1, len(self.pods))
        if not sizes or not _all_of(sizes, int) or not 1 <= min(sizes) <= max(sizes) <= 4096:
            raise ValueError(
                f"num_proc={self.num_proc!r} must be a whole number between 1 and 4096, or one "
                "per pod"
            )
        if isinstance(num_proc, list) and self.pods and len(num_proc) != len(self.pods):
            raise ValueError(f"num_proc has {len(num_proc)} entries for {len(self.pods)} pods")
        self.num_proc, self.sizes = num_proc, list(sizes)
        self.launch_id = _str("launch_id", self.launch_id)
        if self.first_pod or self.first_rank:  # a relay's plan: its subtree's pods only
            for key in ("first_pod", "first_rank"):
                value = getattr(self, key)
                if type(value) is not int or value < 0:
                    raise ValueError(f"{key}={value!r} must be a whole number >= 0")

    def _check_call(self) -> None:
        """The fields of one call."""
        self.id = _str("id", self.id, required=True)
        if self.workers is not None:
            self.workers = _list("workers", self.workers, int)
            lo, n = self.first_pod, len(self.pods)
            if not self.workers or not lo <= min(self.workers) <= max(self.workers) < lo + n:
                raise ValueError(
                    f"workers={self.workers!r} must be pod indices between {lo} and {lo + n - 1}"
                )
        self.timeout = _seconds("timeout", self.timeout, None)
        flags = (self.stream_logs, self.restart, self.shm_results)
        if not _all_of(flags, bool):
            for flag in ("stream_logs", "restart", "shm_results"):
                if type(getattr(self, flag)) is not bool:
                    raise ValueError(f"{flag}={getattr(self, flag)!r} must be true or false")
        if self.shm is not None:
            if not isinstance(self.shm, (list, tuple)) or len(self.shm) != 2:
                raise ValueError("shm must be [path, size]")
            self.shm = list(self.shm)
        self.reattach = min(_seconds("reattach", self.reattach, 0.0, zero_ok=True) or 0.0, 120.0)
        if self.ranks is not None:
            self.ranks = _list("ranks", self.ranks, int)
        if type(self.tree) is not int or self.tree < 0:
            raise ValueError(f"tree={self.tree!r} must be a whole number of children (0: flat)")
        if self.generation is not None and (
            isinstance(self.generation, bool)
            or not isinstance(self.generation, int)
            or self.generation < 0
        ):
            raise ValueError(f"generation={self.generation!r} must be a whole number")
        if self.group_port is not None and (
            isinstance(self.group_port, bool)
            or not isinstance(self.group_port, int)
            or not 0 < self.group_port < 65536
        ):
            raise ValueError(f"group_port={self.group_port!r} must be a TCP port")
        if self.per_rank is not None:
            self.per_rank = rankdata.check_plan(self.per_rank)

    def for_call(
        self,
        call_id: str,
        *,
        timeout: float | None = None,
        stream_logs: bool = True,
        restart: bool = False,
        workers: list[int] | None = None,
        ranks: list[int] | None = None,
        per_rank: dict[str, Any] | None = None,
        tree: int = 0,
    ) -> CallPlan:
        """This plan for one call: a copy with the call's own fields, checked; the pods' part
        (checked when this plan was built) is shared, not checked again. A deployment builds
        its pods' plan once and each call takes one from it."""
        if self._pods_text is None:  # the pods' part, encoded once for every call
            fields_ = vars(self)
            meta = {k: fields_[k] for k, default in _PODS_DEFAULTS if fields_[k] != default}
            self._pods_text = _COMPACT.encode(meta)[1:-1]
        plan: CallPlan = object.__new__(CallPlan)
        vars(plan).update(vars(self))
        plan.id, plan.timeout, plan.stream_logs, plan.restart = (
            call_id,
            timeout,
            stream_logs,
            restart,
        )
        plan.workers, plan.ranks, plan.per_rank, plan.tree = workers, ranks, per_rank, tree
        plan.shm, plan.shm_results, plan.reattach = None, False, 0.0
        plan.generation = plan.group_port = None
        plan._check_call()
        return plan

    def renamed(self, call_id: str) -> CallPlan:
        """A copy of this plan (checked already, as :meth:`for_call` made it) for another call
        with the same fields: only its id differs."""
        plan: CallPlan = object.__new__(CallPlan)
        vars(plan).update(vars(self))
        plan.id = call_id
        return plan

    @classmethod
    def from_meta(cls, meta: Any) -> CallPlan:
        """The plan from its decoded JSON object; a missing or null field is its default,
        an unknown one is ignored (a newer caller's extra)."""
        if not isinstance(meta, dict):
            raise ValueError("the call plan must be a JSON object")
        # filled in place, not through __init__ (this runs for every call on every pod): the
        # defaults (fresh lists), then what was sent, then the checks __post_init__ runs
        plan: CallPlan = object.__new__(cls)
        fields_ = vars(plan)
        fields_.update(_DEFAULTS)
        fields_["pods"], fields_["names"], fields_["id"] = [], [], None
        if _KNOWN.issuperset(meta) and None not in meta.values():  # as a pod sends it
            fields_.update(meta)
        else:  # a newer caller's extra field, or a null: skipped
            for k, v in meta.items():
                if v is not None and k in _KNOWN:
                    fields_[k] = v
        plan._check_pods()
        plan._check_call()  # a missing id fails here, naming it
        return plan

    def to_meta(self) -> dict[str, Any]:
        """The plan as its JSON object: every field that is not its default."""
        meta: dict[str, Any] = {"id": self.id}
        fields_ = vars(self)  # a dict lookup per field, not getattr
        for name, default in _DEFAULT_ITEMS:  # the order of the fields after id
            value = fields_[name]
            if value != default:
                meta[name] = value
        return meta

    def encode(self) -> str:
        """The header's text. A plan made by :meth:`for_call` encodes its call's fields and
        adds its pods' part as text encoded once (the same object, the fields in another
        order)."""
        pods_text = self._pods_text
        if pods_text is None:
            return _COMPACT.encode(self.to_meta())
        meta: dict[str, Any] = {"id": self.id}
        fields_ = vars(self)
        for name, default in _CALL_DEFAULTS:
            value = fields_[name]
            if value != default:
                meta[name] = value
        call_text = _COMPACT.encode(meta)
        return f"{call_text[:-1]},{pods_text}}}" if pods_text else call_text

    def ordinals(self) -> range:
        """The ordinals of the pods this plan names (a relay's: its subtree's)."""
        return range(self.first_pod, self.first_pod + len(self.pods))

    def url(self, i: int) -> str:
        """Pod ``i``'s URL (``i`` an ordinal this plan names)."""
        return self.pods[i - self.first_pod]

    def name(self, i: int) -> str:
        """Pod ``i``'s name (its URL when the caller sent no names)."""
        return self.names[i - self.first_pod] if self.names else self.url(i)

    def pod_ranks(self, i: int) -> range:
        """The global ranks of pod ``i``."""
        at = i - self.first_pod
        start = self.first_rank + sum(self.sizes[:at])
        return range(start, start + self.sizes[at])

    def window(self, subtree: list[int]) -> dict[str, Any]:
        """The pods' part of the plan of a relay that coordinates ``subtree`` (ordinals in
        order, itself first): the pods from its first to its last only, not every pod (at a
        thousand pods the whole list is 45 KB, and pod 0 sends a plan to each of its
        children), and ``workers`` when the subtree skips some of them."""
        lo, hi = subtree[0] - self.first_pod, subtree[-1] - self.first_pod + 1
        num_proc = self.num_proc
        meta: dict[str, Any] = {
            "fanout": True,
            "pods": self.pods[lo:hi],
            "names": self.names[lo:hi],
            "num_proc": num_proc[lo:hi] if isinstance(num_proc, list) else num_proc,
            "first_pod": subtree[0],
            "first_rank": self.pod_ranks(subtree[0]).start,
            "launch_id": self.launch_id,
            "quorum_timeout": self.quorum_timeout,
            "tree": self.tree,
        }
        if len(subtree) != hi - lo:  # the caller's workers= left some of them out
            meta["workers"] = subtree
        return meta

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
        # a null is its default: left out, the header is shorter and decodes in one update
        return {k: v for k, v in meta.items() if v is not None}

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


def _str(key: str, value: Any, required: bool = False) -> str:
    if value in (None, "") and not required:
        return ""
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(
            f"{key} must be a {'non-empty ' if required else ''}string of at most 200 characters"
        )
    return value


def _all_of(values: list[Any] | tuple[Any, ...], kind: type) -> bool:
    """Every value is exactly a ``kind`` (a bool is not an int). A loop, not all() over a
    generator: a plan is checked on every call, and its lists grow with the pods."""
    for v in values:  # noqa: SIM110 - see above
        if type(v) is not kind:
            return False
    return True


def _list(key: str, value: Any, kind: type) -> list[Any]:
    value = [] if value is None else value
    if type(value) is tuple:  # built by the caller in Python; JSON gives lists
        value = list(value)
    if type(value) is not list or not _all_of(value, kind):
        raise ValueError(f"{key} must be a list of {kind.__name__}")
    return value


def _seconds(key: str, value: Any, default: float | None, zero_ok: bool = False) -> float | None:
    if value is None:
        return default
    kind = type(value)  # the usual plain number in one comparison (NaN and inf fail it)
    if (kind is float or kind is int) and (0 < value < math.inf or (zero_ok and value == 0)):
        return float(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
        raise ValueError(f"{key}={value!r} must be a positive number of seconds")
    return float(value)


_FIELDS = tuple(f.name for f in fields(CallPlan) if f.init)
_KNOWN = frozenset(_FIELDS)
_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if callable(f.default_factory) else f.default
    for f in fields(CallPlan)
    if f.name != "sizes"  # set by the checks
}
_DEFAULT_ITEMS = tuple((name, _DEFAULTS[name]) for name in _FIELDS[1:])  # init fields only
# the fields every call to the same pods shares (checked by _check_pods), and the call's own
_PODS_PART = frozenset(
    (
        "pods",
        "names",
        "fanout",
        "quorum_timeout",
        "num_proc",
        "launch_id",
        "first_pod",
        "first_rank",
    )
)
_PODS_DEFAULTS = tuple(item for item in _DEFAULT_ITEMS if item[0] in _PODS_PART)
_CALL_DEFAULTS = tuple(item for item in _DEFAULT_ITEMS if item[0] not in _PODS_PART)


def decode_plan(header: str) -> CallPlan:
    """The plan from its header's text. Raises ValueError (also for JSON that is not one)."""
    try:
        meta = envelope.loads_json(header)
    except RecursionError:
        raise ValueError("the call plan nests too deeply") from None
    return CallPlan.from_meta(meta)
