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
                ``CLOSE`` (the caller stopped reading that stream: as if its HTTP connection
                had closed).
Pod -> caller:  ``HEAD`` (payload: ``status:u16 code_len:u16`` + the error code + the answer's
                body; status 200 opens a frame stream), ``DATA`` (bytes of the frame stream, as
                an HTTP chunk would carry them: any split), ``END`` (the stream is complete).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from ktlite_wire.errors import ProtocolError

HEADER = struct.Struct("<BIQ")
META_LEN = struct.Struct("<I")
HEAD_FIELDS = struct.Struct("<HH")
CALL, CLOSE, HEAD, DATA, END = 1, 2, 3, 4, 5
_KINDS = frozenset((CALL, CLOSE, HEAD, DATA, END))
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
