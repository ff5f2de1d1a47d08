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


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Loaded:
    ok: bool
    error: Bytes | None = None  # the pickled RemoteExceptionInfo (a value message), opaque here


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Result:
    """A call's value (or exception info) inline, or in the shared-memory file ``path``."""

    id: str
    ok: bool
    inline: Bytes | None = field(default=None, repr=False)
    path: str | None = None
    size: int = 0
    has_pg: bool = False  # torch.distributed state lives in the process
    tainted: bool = False  # interrupted inside an import: the pod replaces the process


@dataclass(frozen=True)
class Interrupt:
    id: str


@dataclass(frozen=True)
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
    elif isinstance(msg, Call):
        header = {
            "type": "call",
            "id": msg.id,
            "args": buf(msg.args),
            "path": msg.path,
            "size": msg.size,
            "item": buf(msg.item),
            "item_at": msg.item_at,
            "generation": msg.generation,
            "group_port": msg.group_port,
        }
    elif isinstance(msg, Result):
        header = {
            "type": "result",
            "id": msg.id,
            "ok": msg.ok,
            "inline": buf(msg.inline),
            "path": msg.path,
            "size": msg.size,
            "has_pg": msg.has_pg,
            "tainted": msg.tainted,
        }
    elif isinstance(msg, Interrupt):
        header = {"type": "interrupt", "id": msg.id}
    else:
        header = {"type": "exit"}
    parts = envelope.encode(header, bufs)
    return [LEN.pack(envelope.parts_size(parts)), *parts]


def decode(data: Any) -> Message:
    """One message from its bytes (without the length prefix). Raises ProtocolError."""
    h, bufs = envelope.decode(data, "rank channel message")

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
        if kind == "call":
            at = h.get("item_at")
            port = h.get("group_port")
            return Call(
                id=str(h["id"]),
                args=buf("args"),
                path=h.get("path"),
                size=int(h.get("size", 0)),
                item=buf("item"),
                item_at=None if at is None else [int(at[0]), int(at[1])],
                generation=int(h.get("generation") or 0),
                group_port=None if port is None else int(port),
            )
        if kind == "result":
            return Result(
                id=str(h["id"]),
                ok=bool(h["ok"]),
                inline=buf("inline"),
                path=h.get("path"),
                size=int(h.get("size", 0)),
                has_pg=bool(h.get("has_pg")),
                tainted=bool(h.get("tainted")),
            )
        if kind == "interrupt":
            return Interrupt(str(h["id"]))
        if kind == "exit":
            return Exit()
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"a malformed rank channel message: {type(e).__name__}: {e}") from None
    raise ProtocolError(f"a rank channel message of unknown type {kind!r}")


class Channel:
    """The rank process's end: blocking messages over a socket; sends from several threads
    (concurrent calls) never interleave."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        parts = encode(msg)
        data = envelope.join(parts) if envelope.parts_size(parts) <= 1 << 16 else None
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
    """Queue ``msg`` on the pod server's end (the caller drains)."""
    writer.writelines(encode(msg))
