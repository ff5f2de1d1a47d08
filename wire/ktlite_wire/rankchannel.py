"""The pod server <-> rank process control channel: ``length:u64`` + one message, over a
socketpair. Neither side unpickles a control message; the user's code and values ride as
opaque bytes that only the rank process decodes (and the caller, for a result).

Server -> rank: :class:`Load`, :class:`Call`, :class:`Interrupt`, :class:`Exit`.
Rank -> server: :class:`Ready`, :class:`Loaded`, :class:`Result`, :class:`Written`.

The rare messages are envelopes (``ktlite_wire.envelope``: a JSON header plus buffers). The
two that every call sends, :class:`Call` and :class:`Result`, have a fixed binary header
instead (JSON cost more than the rest of a warm call's work in the rank)::

    Call:   b"KTC" version:u8 flags:u8 id_len:u8 path_len:u16 generation:u32 group_port:u16
            size:u64 item_at:u64*2 args_len:u64 item_len:u64   id path args item
    Result: b"KTR" version:u8 flags:u8 id_len:u8 path_len:u16 size:u64 inline_len:u64
            id path inline

``flags`` say which optional fields are present (a None is not a zero). The rank process's
end of the channel is ``ktlite_wire.rankend``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.launch import Sources, sources_from_json, sources_to_json
from ktlite_wire.version import PROTOCOL_VERSION, mismatch

Bytes = bytes | bytearray | memoryview
LEN = struct.Struct("<Q")
CALL = struct.Struct("<3sBBBHIHQQQQQ")
RESULT = struct.Struct("<3sBBBHQQ")
CALL_MAGIC, RESULT_MAGIC = b"KTC", b"KTR"
# Call flags
_ARGS, _PATH, _ITEM, _ITEM_AT, _PORT = 1, 2, 4, 8, 16
# Result flags (and _PATH)
_OK, _INLINE, _HAS_PG, _TAINTED, _STREAMING, _RELEASED = 1, 4, 8, 16, 32, 64
MAX_MESSAGE = 64 << 30
JOIN_MAX = 1 << 16  # messages up to this size are joined into one write
PIECE = 1 << 20  # a longer message is read in pieces: its buffer grows with the bytes read
READ = 1 << 16  # what one read of the rank's channel takes; a longer message gets its own buffer
WAIT_S = 1.0  # a rank on its bell reads its channel at least this often (an EOF rings not)


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class Load:
    """Load the primary code (``target`` empty) or a colocated target (``drop``: remove it)."""

    env: dict[str, str]
    kind: str = "fn"
    bundle: Bytes | None = field(default=None, repr=False)
    init: Bytes | None = field(default=None, repr=False)
    sources: Sources = field(default_factory=dict, repr=False)
    concurrency: int = 1
    target: str = ""
    drop: bool = False


@dataclass(frozen=True, slots=True)
class Loaded:
    ok: bool
    error: Bytes | None = None  # the pickled RemoteExceptionInfo (a value message), opaque here


@dataclass(slots=True)  # not frozen: a frozen init costs more than the rest of decoding
class Call:
    """Run one call: its arguments inline (``args``) or in the shared-memory file ``path``;
    a per-rank call's own items inline (``item``) or at ``item_at`` in that file."""

    id: str
    args: Bytes | None = field(default=None, repr=False)
    path: str | None = None
    size: int = 0
    item: Bytes | None = field(default=None, repr=False)
    item_at: list[int] | None = None
    generation: int = 0
    group_port: int | None = None


@dataclass(slots=True)  # not frozen: a frozen init costs more than the rest of decoding
class Result:
    """A call's value (or exception info) inline, or in the shared-memory file ``path``.
    ``streaming``: the file has its full ``size`` but the rank is still writing it, and says
    how far it got in :class:`Written` messages (the pod server sends each part as it is
    written, while the rank writes the next). ``released``: the rank let go of its mapping
    of the call's argument file (no view of it alive, no process forked while it was
    mapped): the file may be written again (``ktlite_wire.argfiles``)."""

    id: str
    ok: bool
    inline: Bytes | None = field(default=None, repr=False)
    path: str | None = None
    size: int = 0
    has_pg: bool = False  # torch.distributed state lives in the process
    tainted: bool = False  # interrupted inside an import: the pod replaces the process
    streaming: bool = False  # ``path`` is still being written: Written messages follow
    released: bool = False  # the call's argument file is no longer mapped here (argfiles)


@dataclass(frozen=True, slots=True)
class Written:
    """How much of a streaming result's file the rank has written: ``written`` bytes from
    its start (the last message has them all); ``error``: writing failed there (a full
    ``/dev/shm``), and no more of it comes."""

    id: str
    written: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class Interrupt:
    id: str


@dataclass(frozen=True, slots=True)
class Exit:
    pass


Message = Ready | Load | Loaded | Call | Result | Written | Interrupt | Exit


def encode(msg: Message) -> list[Any]:
    """One message's parts, length prefix first."""
    if isinstance(msg, Call):  # the hot messages first
        return _encode_call(msg)
    if isinstance(msg, Result):
        return _encode_result(msg)
    bufs: list[Any] = []

    def buf(data: Any) -> int | None:
        if data is None:
            return None
        bufs.append(data)
        return len(bufs) - 1

    header: dict[str, Any]
    if isinstance(msg, Ready):
        header = {"type": "ready", "pid": msg.pid}
    elif isinstance(msg, Load):
        header = {
            "type": "load",
            "env": msg.env,
            "kind": msg.kind,
            "bundle": buf(msg.bundle),
            "init": buf(msg.init),
            "sources": sources_to_json(msg.sources),
            "concurrency": msg.concurrency,
            "target": msg.target,
            "drop": msg.drop,
        }
    elif isinstance(msg, Loaded):
        header = {"type": "loaded", "ok": msg.ok, "error": buf(msg.error)}
    elif isinstance(msg, Written):
        header = {"type": "written", "id": msg.id, "written": msg.written, "error": msg.error}
    elif isinstance(msg, Interrupt):
        header = {"type": "interrupt", "id": msg.id}
    else:
        header = {"type": "exit"}
    parts = envelope.encode(header, bufs)
    return [LEN.pack(envelope.parts_size(parts)), *parts]


def _encode_call(msg: Call) -> list[Any]:
    cid, path, args, item, at = msg.id.encode(), b"", msg.args, msg.item, msg.item_at
    flags = 0
    if args is not None:
        flags |= _ARGS
    if msg.path is not None:
        flags, path = flags | _PATH, msg.path.encode()
    if item is not None:
        flags |= _ITEM
    if at is not None:
        flags |= _ITEM_AT
    if msg.group_port is not None:
        flags |= _PORT
    if len(cid) > 255 or len(path) > 65535:
        raise ProtocolError(f"a call id of {len(cid)} bytes or a path of {len(path)}: too long")
    args_len = 0 if args is None else memoryview(args).nbytes
    item_len = 0 if item is None else memoryview(item).nbytes
    head = CALL.pack(
        CALL_MAGIC,
        PROTOCOL_VERSION,
        flags,
        len(cid),
        len(path),
        msg.generation,
        msg.group_port or 0,
        msg.size,
        at[0] if at is not None else 0,
        at[1] if at is not None else 0,
        args_len,
        item_len,
    )
    n = CALL.size + len(cid) + len(path) + args_len + item_len
    parts: list[Any] = [LEN.pack(n) + head + cid + path]
    if args_len:
        parts.append(args)
    if item_len:
        parts.append(item)
    return parts


def _encode_result(msg: Result) -> list[Any]:
    cid, path, inline = msg.id.encode(), b"", msg.inline
    flags = _OK if msg.ok else 0
    if msg.path is not None:
        flags, path = flags | _PATH, msg.path.encode()
    if inline is not None:
        flags |= _INLINE
    if msg.has_pg:
        flags |= _HAS_PG
    if msg.tainted:
        flags |= _TAINTED
    if msg.streaming:
        flags |= _STREAMING
    if msg.released:
        flags |= _RELEASED
    if len(cid) > 255 or len(path) > 65535:
        raise ProtocolError(f"a call id of {len(cid)} bytes or a path of {len(path)}: too long")
    inline_len = 0 if inline is None else memoryview(inline).nbytes
    head = RESULT.pack(
        RESULT_MAGIC, PROTOCOL_VERSION, flags, len(cid), len(path), msg.size, inline_len
    )
    n = RESULT.size + len(cid) + len(path) + inline_len
    first = LEN.pack(n) + head + cid + path
    return [first, inline] if inline_len else [first]


_FRAMED_RESULT = struct.Struct("<Q3sBBBHQQ")  # LEN and RESULT in one


def result_frame(
    call_id: str,
    ok: bool,
    inline: bytes,
    has_pg: bool = False,
    tainted: bool = False,
    released: bool = False,
) -> bytes:
    """``encode(Result(call_id, ok, inline, None, len(inline), ...))`` joined: the bytes of an
    inline result, built in one step (a rank sends one per call)."""
    cid = call_id.encode()
    if len(cid) > 255:
        raise ProtocolError(f"a call id of {len(cid)} bytes: too long")
    n = len(inline)
    flags = _INLINE
    if ok:
        flags |= _OK
    if has_pg:
        flags |= _HAS_PG
    if tainted:
        flags |= _TAINTED
    if released:
        flags |= _RELEASED
    head = _FRAMED_RESULT.pack(
        RESULT.size + len(cid) + n, RESULT_MAGIC, PROTOCOL_VERSION, flags, len(cid), 0, n, n
    )
    return head + cid + inline


def decode(data: Any) -> Message:
    """One message from its bytes (without the length prefix). Raises ProtocolError."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    magic = bytes(view[:3])
    if magic in (CALL_MAGIC, RESULT_MAGIC):
        return _decode_hot(view, magic)
    head, bufs = envelope.decode_json(view, "rank channel message")
    if not isinstance(head, dict):
        raise ProtocolError("a rank channel message's header must be a JSON object")
    h: dict[str, Any] = head

    def buf(key: str) -> memoryview | None:  # a view of ``data``: no copy
        return envelope.buffer(bufs, h.get(key), f"a rank message's {key}")

    try:
        kind = h["type"]
        if kind == "ready":
            return Ready(int(h["pid"]))
        if kind == "load":
            env = h["env"]
            if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
                raise ValueError("env must map names to strings")
            return Load(
                env={str(k): v for k, v in env.items()},
                kind=str(h["kind"]),
                bundle=buf("bundle"),
                init=buf("init"),
                sources=sources_from_json(h.get("sources")),
                concurrency=int(h.get("concurrency", 1)),
                target=str(h.get("target") or ""),
                drop=bool(h.get("drop")),
            )
        if kind == "loaded":
            return Loaded(bool(h["ok"]), buf("error"))
        if kind == "written":
            return Written(str(h["id"]), int(h["written"]), str(h.get("error") or ""))
        if kind == "interrupt":
            return Interrupt(str(h["id"]))
        if kind == "exit":
            return Exit()
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"a malformed rank channel message: {type(e).__name__}: {e}") from None
    raise ProtocolError(f"a rank channel message of unknown type {kind!r}")


def _decode_hot(view: memoryview, magic: bytes) -> Message:
    """A Call or a Result: a fixed binary header, then its strings and bytes (views of
    ``view``: no copies)."""
    layout = CALL if magic == CALL_MAGIC else RESULT
    if view.nbytes < layout.size:
        raise ProtocolError(f"a rank channel message truncated: {view.nbytes} bytes")
    fields = layout.unpack_from(view)
    if fields[1] != PROTOCOL_VERSION:
        raise ProtocolError(
            mismatch(fields[1], them="a rank channel message", us="this pod server")
        )
    flags, id_len, path_len = fields[2], fields[3], fields[4]
    pos = layout.size
    try:
        cid = str(view[pos : pos + id_len], "utf-8")
        pos += id_len
        path = str(view[pos : pos + path_len], "utf-8") if flags & _PATH else None
    except UnicodeDecodeError as e:
        raise ProtocolError(f"a malformed rank channel message: {e}") from None
    pos += path_len
    if magic == CALL_MAGIC:
        generation, port, size, at0, at1, args_len, item_len = fields[5:]
        end = pos + args_len + item_len
        args = view[pos : pos + args_len] if flags & _ARGS else None
        item = view[pos + args_len : end] if flags & _ITEM else None
        msg: Message = Call(  # by position, as Result below
            cid,  # id
            args,
            path,
            size,
            item,
            [at0, at1] if flags & _ITEM_AT else None,  # item_at
            generation,
            port if flags & _PORT else None,  # group_port
        )
    else:
        size, inline_len = fields[5:]
        end = pos + inline_len
        # by position: keywords cost a dict and its unpacking (~0.3 us), and a pod server
        # decodes one Result per rank per call
        msg = Result(
            cid,  # id
            (flags & _OK) != 0,  # ok (a comparison, not a call of bool())
            view[pos:end] if flags & _INLINE else None,  # inline
            path,
            size,
            (flags & _HAS_PG) != 0,  # has_pg
            (flags & _TAINTED) != 0,  # tainted
            (flags & _STREAMING) != 0,  # streaming
            (flags & _RELEASED) != 0,  # released
        )
    if end != view.nbytes:
        raise ProtocolError(
            f"a malformed rank channel message: its fields take {end} bytes, it has {view.nbytes}"
        )
    return msg


def frame(msg: Message) -> list[Any]:
    """``msg`` as the pod server writes it: a small message joined into one part (one
    segment, so the rank's read wakes once), a large one as its parts (no copy). A call sent
    to many ranks is framed once and the same parts written to each."""
    parts = encode(msg)
    return [envelope.join(parts)] if message_size(parts) <= JOIN_MAX else parts


def message_size(parts: list[Any]) -> int:
    """An encoded message's size, from its length prefix (the first part begins with it)."""
    (n,) = LEN.unpack_from(parts[0])
    return LEN.size + int(n)
