"""The pod server <-> rank process control channel: ``length:u64`` + one envelope message
(a JSON header plus buffers) per message, over a socketpair. Neither side unpickles a
control message; the user's code and values ride in buffers as opaque bytes that only the
rank process decodes (and the caller, for a result).

Server -> rank: :class:`Load`, :class:`Call`, :class:`Interrupt`, ``{"type": "exit"}``.
Rank -> server: :class:`Ready`, :class:`Loaded`, :class:`Result`.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.launch import Sources, sources_from_json, sources_to_json

Bytes = bytes | bytearray | memoryview
LEN = struct.Struct("<Q")
MAX_MESSAGE = 64 << 30
JOIN_MAX = 1 << 16  # messages up to this size are joined into one write


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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Result:
    """A call's value (or exception info) inline, or in the shared-memory file ``path``."""

    id: str
    ok: bool
    inline: Bytes | None = field(default=None, repr=False)
    path: str | None = None
    size: int = 0
    has_pg: bool = False  # torch.distributed state lives in the process
    tainted: bool = False  # interrupted inside an import: the pod replaces the process


@dataclass(frozen=True, slots=True)
class Interrupt:
    id: str


@dataclass(frozen=True, slots=True)
class Exit:
    pass


Message = Ready | Load | Loaded | Call | Result | Interrupt | Exit


def encode(msg: Message) -> list[Any]:
    """One message's parts, length prefix first."""
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
    elif isinstance(msg, Call):  # the hot messages are JSON lists (cheaper than objects)
        hot: list[Any] = [
            "call",
            msg.id,
            buf(msg.args),
            msg.path,
            msg.size,
            buf(msg.item),
            msg.item_at,
            msg.generation,
            msg.group_port,
        ]
        parts = envelope.encode(hot, bufs)
        return [LEN.pack(envelope.parts_size(parts)), *parts]
    elif isinstance(msg, Result):
        hot = [
            "result",
            msg.id,
            msg.ok,
            buf(msg.inline),
            msg.path,
            msg.size,
            msg.has_pg,
            msg.tainted,
        ]
        parts = envelope.encode(hot, bufs)
        return [LEN.pack(envelope.parts_size(parts)), *parts]
    elif isinstance(msg, Interrupt):
        header = {"type": "interrupt", "id": msg.id}
    else:
        header = {"type": "exit"}
    parts = envelope.encode(header, bufs)
    return [LEN.pack(envelope.parts_size(parts)), *parts]


def decode(data: Any) -> Message:
    """One message from its bytes (without the length prefix). Raises ProtocolError."""
    head, bufs = envelope.decode_json(data, "rank channel message")
    if isinstance(head, list):
        return _decode_hot(head, bufs)
    if not isinstance(head, dict):
        raise ProtocolError("a rank channel message's header must be a JSON object or list")
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
        if kind == "interrupt":
            return Interrupt(str(h["id"]))
        if kind == "exit":
            return Exit()
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"a malformed rank channel message: {type(e).__name__}: {e}") from None
    raise ProtocolError(f"a rank channel message of unknown type {kind!r}")


def _decode_hot(h: list[Any], bufs: list[memoryview]) -> Message:
    """A Call or a Result: their headers are positional lists."""
    try:
        if h[0] == "call" and len(h) == 9:
            _, cid, args, path, size, item, at, generation, port = h
            return Call(
                id=str(cid),
                args=envelope.buffer(bufs, args, "a call's arguments"),
                path=None if path is None else str(path),
                size=int(size),
                item=envelope.buffer(bufs, item, "a call's per-rank item"),
                item_at=None if at is None else [int(at[0]), int(at[1])],
                generation=int(generation or 0),
                group_port=None if port is None else int(port),
            )
        if h[0] == "result" and len(h) == 8:
            _, cid, ok, inline, path, size, has_pg, tainted = h
            return Result(
                id=str(cid),
                ok=bool(ok),
                inline=envelope.buffer(bufs, inline, "a result's value"),
                path=None if path is None else str(path),
                size=int(size),
                has_pg=bool(has_pg),
                tainted=bool(tainted),
            )
    except (TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"a malformed rank channel message: {type(e).__name__}: {e}") from None
    raise ProtocolError(f"a rank channel message of unknown form {str(h)[:80]!r}")


class Channel:
    """The rank process's end: blocking messages over a socket; sends from several threads
    (concurrent calls) never interleave."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        parts = encode(msg)
        data = envelope.join(parts) if envelope.parts_size(parts) <= JOIN_MAX else None
        with self._send_lock:
            if data is not None:
                self.sock.sendall(data)
                return
            for p in parts:
                self.sock.sendall(p)

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the pod server closed the control channel")
            got += k
        return buf

    def recv(self) -> Message:
        (n,) = LEN.unpack(self._exactly(LEN.size))
        if n > MAX_MESSAGE:
            raise ProtocolError(f"a rank channel message claims {n} bytes")
        return decode(self._exactly(n))


async def read(reader: asyncio.StreamReader) -> Message:
    """The pod server's end: the next message. Raises IncompleteReadError at EOF."""
    (n,) = LEN.unpack(await reader.readexactly(LEN.size))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"a rank channel message claims {n} bytes")
    return decode(await reader.readexactly(n))


def write(writer: asyncio.StreamWriter, msg: Message) -> None:
    """Queue ``msg`` on the pod server's end (the caller drains): a small message in one
    write (one segment, so the rank's read wakes once), a large one without copying."""
    parts = encode(msg)
    if envelope.parts_size(parts) <= JOIN_MAX:
        writer.write(envelope.join(parts))
    else:
        writer.writelines(parts)
