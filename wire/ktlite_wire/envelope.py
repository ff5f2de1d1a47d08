"""The framing of every ktlite message: a JSON header plus opaque buffers::

    MAGIC version:u8 nbufs:u32 head_len:u64 buf_len:u64*nbufs  head  [pad buf]*nbufs

Buffers start on 64-byte boundaries (so arrays can be used in place) and are never
interpreted here. A typed message (``ktlite_wire.launch``, ``.outcome``, ...) is the JSON
header; user code and values ride in its buffers. The same layout with a pickle stream in
place of the JSON header carries user values (``ktlite_wire.codec``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import Any

from ktlite_wire.errors import ProtocolError
from ktlite_wire.version import PROTOCOL_VERSION, mismatch

MAGIC = b"KTJ"
HEAD = struct.Struct("<3sBIQ")
_HEAD_SIZE = HEAD.size
ALIGN = 64
MAX_BUFFERS = 1 << 20

Buffer = bytes | bytearray | memoryview


def _pad(n: int) -> int:
    return (-n) % ALIGN


def pack(magic: bytes, body: list[Any], buffers: list[memoryview]) -> list[Any]:
    """The parts of one message: head, ``body`` (the header's bytes, in pieces), padded
    buffers. Nothing is copied."""
    blen = parts_size(body)
    head = HEAD.pack(magic, PROTOCOL_VERSION, len(buffers), blen)
    if not buffers:  # a value small enough to travel in its pickle stream, or a typed message
        return [head, *body]
    head += struct.pack(f"<{len(buffers)}Q", *[b.nbytes for b in buffers])
    parts: list[Any] = [head, *body]
    offset = len(head) + blen
    for buf in buffers:
        pad = _pad(offset)
        if pad:
            parts.append(b"\0" * pad)
        parts.append(buf)
        offset += pad + buf.nbytes
    return parts


def unpack(magic: bytes, data: Any, what: str) -> tuple[memoryview, list[memoryview]]:
    """Check one message's framing (magic, version, buffer table, sizes): its header's
    bytes and its buffers, as views of ``data`` (no copies). Raises ProtocolError."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:  # (a bytearray's view is already bytes)
        view = view.cast("B")
    size = view.nbytes
    if size < _HEAD_SIZE:
        raise ProtocolError(f"{what} truncated: {size} bytes, its header needs {HEAD.size}")
    got, version, nbufs, blen = HEAD.unpack_from(view)
    if not nbufs and got == magic and version == PROTOCOL_VERSION and size == _HEAD_SIZE + blen:
        return view[_HEAD_SIZE:], []  # the usual small value, whole: the checks below in one
    if got != magic:
        raise ProtocolError(f"not a ktlite {what} (magic {bytes(got)!r}, expected {magic!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            mismatch(
                version, them=f"a {what} of protocol version {version}: its sender", us="this side"
            )
        )
    pos = HEAD.size
    if not nbufs:  # a small value or a typed message: its header is all of it
        body = view[pos : pos + blen]
        if body.nbytes != blen:
            raise ProtocolError(f"{what} truncated in its header ({body.nbytes} of {blen} bytes)")
        return body, []
    if nbufs > MAX_BUFFERS or view.nbytes < pos + 8 * nbufs:
        raise ProtocolError(f"{what} truncated in its buffer table")
    lens = struct.unpack_from(f"<{nbufs}Q", view, pos)
    pos += 8 * nbufs
    body = view[pos : pos + blen]
    if body.nbytes != blen:
        raise ProtocolError(f"{what} truncated in its header ({body.nbytes} of {blen} bytes)")
    pos += blen
    bufs = []
    for n in lens:
        pos += (-pos) % ALIGN  # _pad, inline: a loop per buffer of every result
        if pos + n > view.nbytes:
            raise ProtocolError(
                f"{what} truncated: a buffer of {n} bytes runs past its end ({view.nbytes})"
            )
        bufs.append(view[pos : pos + n])
        pos += n
    return body, bufs


def encode(header: dict[str, Any] | list[Any], buffers: Iterable[Buffer] = ()) -> list[Any]:
    """A typed message's parts: ``header`` as JSON, then ``buffers`` untouched."""
    body = json.dumps(header).encode()
    return pack(MAGIC, [body], [memoryview(b).cast("B") for b in buffers])


def encode_bytes(header: dict[str, Any] | list[Any], buffers: Iterable[Buffer] = ()) -> bytes:
    return join(encode(header, buffers))


def decode(data: Any, what: str = "message") -> tuple[dict[str, Any], list[memoryview]]:
    """A typed message's JSON header (an object) and its buffers (views of ``data``)."""
    header, bufs = decode_json(data, what)
    if not isinstance(header, dict):
        raise ProtocolError(f"{what}: its header must be a JSON object")
    return header, bufs


_DECODER = json.JSONDecoder()


def loads_json(text: str) -> Any:
    """``json.loads`` for a header this wire wrote (no whitespace around it): the same
    errors, without its two regular-expression scans (it runs several times per call)."""
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        end = -1
    if end != len(text):  # whitespace around the value is fine; json.loads says what is not
        value = json.loads(text)
    return value


def decode_json(data: Any, what: str = "message") -> tuple[Any, list[memoryview]]:
    """A message's JSON header, of any JSON type (a hot message's is a list: cheaper to
    make and read than an object), and its buffers."""
    body, bufs = unpack(MAGIC, data, what)
    try:
        header = loads_json(str(body, "utf-8"))  # a str: json.loads sniffs a bytes' encoding
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"{what}: its header is not JSON: {e}") from None
    return header, bufs


def buffer(bufs: list[memoryview], index: Any, what: str) -> memoryview | None:
    """The buffer a header field names by index (None stays None)."""
    if index is None:
        return None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(bufs):
        raise ProtocolError(f"{what} names buffer {index!r}; the message has {len(bufs)}")
    return bufs[index]


def parts_size(parts: Iterable[Any]) -> int:
    n = 0
    for p in parts:  # a loop, not sum() over a generator: this runs several times per call
        n += len(p) if type(p) is bytes or type(p) is bytearray else memoryview(p).nbytes
    return n


def join(parts: Iterable[Any]) -> bytes:
    return b"".join(parts)  # takes any buffer (memoryviews of any format, by their bytes)


def chunked(parts: Iterable[Any], size: int = 4 << 20) -> Iterator[memoryview]:
    """Split parts into chunks of at most ``size`` bytes without copying."""
    for part in parts:
        mv = memoryview(part).cast("B")
        for i in range(0, mv.nbytes, size):
            yield mv[i : i + size]
