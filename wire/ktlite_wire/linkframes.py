"""The messages of a link: one persistent connection to a pod server that carries many calls
at once, each numbered by the link: from another pod (``ktlite_server.linkclient``), or from
the caller (``ktlite.net.podlinks``: submitted calls to a pod it reaches directly); the pod's
end is ``ktlite_server.linkserver``.

A link begins as an HTTP request on the pod server's own port (``POST /link`` with the
deployment's token, over TLS where the deployment has it), answered ``101``; from then on both
sides write messages, each a fixed header and a payload::

    kind:u8 stream:u32 length:u64   payload

A call's stream number is the link's own (the caller of the link picks it), not the call id.

Caller -> pod:  ``CALL`` (payload: ``meta_len:u32`` + the call plan's header + the body),
                ``RUN`` (a member's share of a call its coordinator fanned out, in binary:
                ``flags:u8 generation:u32 group_port:u16 id_len:u16 launch_len:u16`` + the
                call id + the launch id + the body; ``memberrun``; or, from the caller, a
                call to that one pod, flagged ``COORDINATE``: the pod picks the process
                group's generation and port as for a ``CALL``, ``callerrun``), ``CLOSE`` (the
                caller stopped reading that stream: as if its HTTP connection had closed),
                ``STOP`` (stop a call by its id, as ``POST /cancel`` does, on stream 0 and
                unanswered: ``kind:u8 reset:u8 id_len:u16`` + the call id + the reason).
Pod -> caller:  ``HEAD`` (payload: ``status:u16 code_len:u16`` + the error code + the answer's
                body; status 200 opens a frame stream), ``DATA`` (bytes of the frame stream, as
                an HTTP chunk would carry them: any split), ``END`` (the stream is complete),
                ``DONE`` (a ``RUN``'s outcomes, in binary, and the stream's end:
                ``pod_len:u16 count:u32`` + the pod's name, then per rank ``rank:u32
                status:u8 at:f64 message_len:u32 kind:u8 data_len:u64 size:u64`` + the
                message + the value's bytes, or a shared-memory file's path), ``GOAWAY``
                (the pod closes the link, idle: a ``RUN`` it has not answered never ran).

A ``CALL`` is acknowledged by its ``HEAD``; a ``RUN`` that the pod accepts has no head (its
first message is a frame or its ``DONE``; one it refuses is answered with a ``HEAD``): the pod
closes a link only after a ``GOAWAY``, or when it dies, so a ``RUN`` is sent again only on a
link that said ``GOAWAY`` before any answer to it came.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

from ktlite_wire.errors import ProtocolError
from ktlite_wire.outcome import RankOutcome, ShmRef
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status

HEADER = struct.Struct("<BIQ")
META_LEN = struct.Struct("<I")
HEAD_FIELDS = struct.Struct("<HH")
CALL, CLOSE, HEAD, DATA, END, RUN, DONE, GOAWAY, STOP = 1, 2, 3, 4, 5, 6, 7, 8, 9
_KINDS = frozenset((CALL, CLOSE, HEAD, DATA, END, RUN, DONE, GOAWAY, STOP))
RUN_FIELDS = struct.Struct("<BIHHH")
# a RUN's flags; COORDINATE: the caller's call to this pod alone (its generation and port
# fields are 0: the pod picks them, as it does for a CALL it coordinates)
STREAM_LOGS, RESTART, SHM_RESULTS, COORDINATE = 1, 2, 4, 8
DONE_HEAD = struct.Struct("<HI")
DONE_ROW = struct.Struct("<IBdIBQQ")
NO_VALUE, VALUE, SHM_VALUE = 0, 1, 2  # what a DONE row carries
_STATUSES = tuple(Status)
_STATUS_INDEX = {s: i for i, s in enumerate(_STATUSES)}
STOP_FIELDS = struct.Struct("<BBH")
STOPS = (Status.CANCELLED, Status.TIMEOUT)  # what a STOP may say a call ended with
REASON_MAX = 500  # a STOP's reason is cut to this many characters (as POST /cancel's)
PATH = "/link"  # the pod server's endpoint that turns a connection into a link
# the pod server's answer to a link request; anything else is an HTTP answer (401, 409, ...)
SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: ktlite-link\r\nconnection: upgrade\r\n\r\n"
MAX_PAYLOAD = 64 << 30  # a message longer than this is a broken or hostile peer


def header(kind: int, stream: int, length: int) -> bytes:
    return HEADER.pack(kind, stream, length)


def call_message(stream: int, meta: str, body: list[memoryview]) -> list[Any]:
    """A ``CALL``: the plan's header and the body, the body's pieces never joined."""
    encoded = meta.encode()
    size = META_LEN.size + len(encoded) + sum(p.nbytes for p in body)
    return [header(CALL, stream, size), META_LEN.pack(len(encoded)), encoded, *body]


def split_call(payload: memoryview) -> tuple[str, memoryview]:
    """A ``CALL``'s plan header and body."""
    if payload.nbytes < META_LEN.size:
        raise ProtocolError(f"a link CALL of {payload.nbytes} bytes has no plan")
    (n,) = META_LEN.unpack_from(payload)
    if META_LEN.size + n > payload.nbytes:
        raise ProtocolError(f"a link CALL's plan of {n} bytes runs past its message")
    meta = bytes(payload[META_LEN.size : META_LEN.size + n]).decode()
    return meta, payload[META_LEN.size + n :]


def run_fields(
    call_id: str,
    launch_id: str,
    generation: int,
    group_port: int | None,
    stream_logs: bool,
    restart: bool,
    shm_results: bool,
) -> bytes:
    """A ``RUN``'s payload before its body: the same for every member of a call."""
    flags = (STREAM_LOGS if stream_logs else 0) | (RESTART if restart else 0)
    flags |= SHM_RESULTS if shm_results else 0
    cid, lid = call_id.encode(), launch_id.encode()
    fields = RUN_FIELDS.pack(flags, generation, group_port or 0, len(cid), len(lid))
    return fields + cid + lid


def plan_run(plan: CallPlan) -> bytes | None:
    """The ``RUN`` fields of a member's share of ``plan`` (None: the call needs its plan: a
    per-rank call, one on some ranks only, arguments in shared memory)."""
    if plan.per_rank is not None or plan.ranks is not None or plan.shm is not None:
        return None
    return run_fields(
        plan.id,
        plan.launch_id,
        plan.generation or 0,
        plan.group_port,
        plan.stream_logs,
        plan.restart,
        plan.shm_results,
    )


def caller_run(plan: CallPlan) -> bytes | None:
    """The ``RUN`` fields of the caller's call ``plan`` to one pod (``COORDINATE``), or None
    when the call needs its plan: several pods, a timeout, a re-attach window, per-rank
    items, some ranks only, arguments in shared memory."""
    if (
        len(plan.pods) != 1
        or plan.workers is not None
        or plan.timeout is not None
        or plan.reattach
        or plan.tree
        or plan.first_pod
        or plan.generation is not None
        or plan.per_rank is not None
        or plan.ranks is not None
        or plan.shm is not None
    ):
        return None
    flags = COORDINATE | (STREAM_LOGS if plan.stream_logs else 0) | (RESTART if plan.restart else 0)
    flags |= SHM_RESULTS if plan.shm_results else 0
    cid, lid = plan.id.encode(), plan.launch_id.encode()
    return RUN_FIELDS.pack(flags, 0, 0, len(cid), len(lid)) + cid + lid


def run_message(stream: int, fields: bytes, body: list[memoryview]) -> list[Any]:
    size = len(fields) + sum(p.nbytes for p in body)
    return [header(RUN, stream, size), fields, *body]


class Run(NamedTuple):
    """A ``RUN``'s fields, read."""

    call_id: str
    launch_id: str
    flags: int
    generation: int
    group_port: int | None
    body: memoryview


def split_run(payload: memoryview) -> Run:
    if payload.nbytes < RUN_FIELDS.size:
        raise ProtocolError(f"a link RUN of {payload.nbytes} bytes")
    flags, generation, port, n_id, n_launch = RUN_FIELDS.unpack_from(payload)
    at = RUN_FIELDS.size + n_id + n_launch
    if not 0 < n_id <= 800 or n_launch > 800 or at > payload.nbytes:
        raise ProtocolError(f"a link RUN's ids of {n_id} and {n_launch} bytes")
    call_id = bytes(payload[RUN_FIELDS.size : RUN_FIELDS.size + n_id]).decode()
    launch_id = bytes(payload[RUN_FIELDS.size + n_id : at]).decode()
    return Run(call_id, launch_id, flags, generation, port or None, payload[at:])


def done_message(stream: int, pod: str, outcomes: list[RankOutcome]) -> list[Any]:
    """A ``DONE``: every outcome of a ``RUN`` on this pod, values as they are (not joined).
    Raises TypeError for a value that is neither bytes nor a shared-memory file."""
    name = pod.encode()
    parts: list[Any] = [b"", DONE_HEAD.pack(len(name), len(outcomes)), name]
    size = DONE_HEAD.size + len(name)
    for o in outcomes:
        message, value, kind, n = o.message.encode(), o.data, NO_VALUE, 0
        data: Any = None
        if type(value) is ShmRef:
            kind, data, n = SHM_VALUE, value.path.encode(), value.size
        elif value is not None:
            kind, data = VALUE, memoryview(value).cast("B")
        length = 0 if data is None else len(data) if type(data) is bytes else data.nbytes
        at = o.at if o.status is not Status.OK else 0.0
        row = DONE_ROW.pack(o.rank, _STATUS_INDEX[o.status], at, len(message), kind, length, n)
        parts += (row, message) if data is None else (row, message, data)
        size += DONE_ROW.size + len(message) + length
    parts[0] = header(DONE, stream, size)
    return parts


def read_done(payload: memoryview) -> list[RankOutcome]:
    """A ``DONE``'s outcomes (values are views of ``payload``). Raises ProtocolError."""
    if payload.nbytes < DONE_HEAD.size:
        raise ProtocolError(f"a link DONE of {payload.nbytes} bytes")
    n_name, count = DONE_HEAD.unpack_from(payload)
    at = DONE_HEAD.size + n_name
    pod = bytes(payload[DONE_HEAD.size : at]).decode(errors="replace")
    outs: list[RankOutcome] = []
    end = payload.nbytes
    for _ in range(count):
        if at + DONE_ROW.size > end:
            raise ProtocolError(f"a link DONE names {count} outcomes and ends after {len(outs)}")
        rank, status, when, n_msg, kind, length, size = DONE_ROW.unpack_from(payload, at)
        at += DONE_ROW.size
        if status >= len(_STATUSES) or kind > SHM_VALUE or at + n_msg + length > end:
            raise ProtocolError(f"a malformed outcome of rank {rank} in a link DONE")
        message = bytes(payload[at : at + n_msg]).decode(errors="replace") if n_msg else ""
        at += n_msg
        data: Any = None
        if kind == VALUE:
            data = payload[at : at + length]
        elif kind == SHM_VALUE:
            data = ShmRef(bytes(payload[at : at + length]).decode(errors="replace"), size)
        at += length
        outs.append(RankOutcome(rank, pod, _STATUSES[status], data, message, when))
    return outs


class Stop(NamedTuple):
    """A ``STOP``'s fields: the call, how it ends, why, and whether a pod that is not running
    it resets its ranks (a call that ended there may have left them in a collective)."""

    call_id: str
    kind: Status
    reason: str
    reset: bool


def stop_message(stop: Stop) -> bytes:
    cid, reason = stop.call_id.encode(), stop.reason[:REASON_MAX].encode()
    fields = STOP_FIELDS.pack(STOPS.index(stop.kind), 1 if stop.reset else 0, len(cid))
    return header(STOP, 0, len(fields) + len(cid) + len(reason)) + fields + cid + reason


def split_stop(payload: memoryview) -> Stop:
    """A ``STOP``'s fields. Raises ProtocolError."""
    if payload.nbytes < STOP_FIELDS.size:
        raise ProtocolError(f"a link STOP of {payload.nbytes} bytes")
    kind, reset, n_id = STOP_FIELDS.unpack_from(payload)
    at = STOP_FIELDS.size + n_id
    if kind >= len(STOPS) or reset > 1 or not 0 < n_id <= 800 or at > payload.nbytes:
        raise ProtocolError(f"a malformed link STOP (kind {kind}, an id of {n_id} bytes)")
    try:
        call_id = bytes(payload[STOP_FIELDS.size : at]).decode()
    except UnicodeDecodeError as e:
        raise ProtocolError(f"a link STOP's call id is not UTF-8: {e}") from None
    reason = bytes(payload[at:]).decode(errors="replace")[:REASON_MAX]
    return Stop(call_id, STOPS[kind], reason, bool(reset))


def head_message(stream: int, status: int, code: str = "", body: bytes = b"") -> bytes:
    encoded = code.encode()
    payload = HEAD_FIELDS.pack(status, len(encoded)) + encoded + body
    return header(HEAD, stream, len(payload)) + payload


def split_head(payload: memoryview) -> tuple[int, str, bytes]:
    """A ``HEAD``'s status, error code (empty: none) and body."""
    if payload.nbytes < HEAD_FIELDS.size:
        raise ProtocolError(f"a link HEAD of {payload.nbytes} bytes")
    status, n = HEAD_FIELDS.unpack_from(payload)
    code = bytes(payload[HEAD_FIELDS.size : HEAD_FIELDS.size + n]).decode(errors="replace")
    return status, code, bytes(payload[HEAD_FIELDS.size + n :])


class Reader:
    """Messages out of the bytes of a link, however they were split: ``feed`` yields each
    complete ``(kind, stream, payload)``. A payload is a view of the bytes received; a long one
    is kept whole in one buffer (it grows with the bytes read, never joined twice)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._want: tuple[int, int, int] | None = None  # a header read, its payload awaited
        self._body: bytearray | None = None
        self._got = 0

    def feed(self, data: bytes) -> Iterator[tuple[int, int, memoryview]]:
        view = memoryview(data)
        if self._buf:  # the rest of a header that came split
            self._buf += view
            view, self._buf = memoryview(bytes(self._buf)), bytearray()
        while True:
            if self._want is not None:  # a payload that arrives in pieces
                kind, stream, length = self._want
                assert self._body is not None
                take = min(length - self._got, view.nbytes)
                self._body[self._got : self._got + take] = view[:take]
                self._got += take
                view = view[take:]
                if self._got < length:
                    return
                body, self._body, self._want = self._body, None, None
                yield kind, stream, memoryview(body)
                continue
            if view.nbytes < HEADER.size:
                if view.nbytes:
                    self._buf += view
                return
            kind, stream, length = HEADER.unpack_from(view)
            if kind not in _KINDS or length > MAX_PAYLOAD:
                raise ProtocolError(f"not a link message: kind {kind}, {length} bytes")
            end = HEADER.size + length
            if view.nbytes >= end:  # the usual case: whole in what arrived, no copy
                yield kind, stream, view[HEADER.size : end]
                view = view[end:]
                continue
            self._want, self._body, self._got = (kind, stream, length), bytearray(length), 0
            view = view[HEADER.size :]
