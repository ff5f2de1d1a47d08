"""The wire contract shared by the client and the pod server (stdlib + cloudpickle only).

A *message* is pickle protocol 5 with its large buffers carried out of band::

    b"KTL" version:u8 nbufs:u32 pickle_len:u64 buf_len:u64*nbufs  pickle  [pad buf]*nbufs

Buffers start on 64-byte boundaries so numpy / torch can use them in place. Decoding a
message held in a writable buffer gives arrays backed by that buffer: no copies, no base64.

A *frame stream* is what ``POST /call`` answers with: ``kind:u8 length:u64 payload``
frames, logs interleaved with the final result, so a caller sees every rank's output live.
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ktlite import sourcelines

PROTOCOL_VERSION = 3  # 3: chunked bodies, re-attachable calls, notices, shipped sources
MAGIC = b"KTL"
_HEAD = struct.Struct("<3sBIQ")
_ALIGN = 64

# HTTP headers
# Not "authorization": the Kubernetes API server consumes that header (its own credentials)
# and never forwards it through the pod proxy.
TOKEN_HEADER = "x-ktlite-token"
CALL_HEADER = "x-ktlite-call"
VERSION_HEADER = "x-ktlite-protocol"
# A body sent chunked (through the Kubernetes API server's proxy: see ktlite.client) names its
# length here, so the pod can still refuse an oversized one before reading it
LENGTH_HEADER = "x-ktlite-length"
# A caller re-attaching to a call it lost the stream of: the number of the first frame it lacks
RESUME_HEADER = "x-ktlite-resume"
# A pod refusing a call for want of code says how long its server has been up (seconds): a
# caller whose earlier attempt was cut knows then whether that attempt met this same server
UPTIME_HEADER = "x-ktlite-uptime"

# frame kinds
FRAME = struct.Struct("<BQ")
LOG, RESULT, ERROR, HEARTBEAT, NOTICE = 1, 2, 3, 4, 5
MAX_FRAME = 64 << 30  # no result frame is larger; a bigger claim is corruption, not data

# out-of-band threshold: smaller buffers stay in the pickle stream
_OOB_MIN = 4096


class ProtocolError(ValueError):
    """A malformed or truncated message."""


@dataclass
class RemoteExceptionInfo:
    """An exception raised on a rank: its pickle when it round-trips, always its text."""

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None = None


def _pad(n: int) -> int:
    return (-n) % _ALIGN


class _Pickler(cloudpickle.Pickler):
    """cloudpickle plus out-of-band buffers for CPU torch tensors (cloudpickle copies them)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


class _SourcePickler(_Pickler):
    """Code shipped by value carries its file's source lines (the caller's side only: what
    a pod sends back needs none, its code came from the caller)."""

    dispatch_table = sourcelines.DISPATCH_TABLE


def _reduce_tensor(torch: Any, t: Any) -> Any:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    if t.requires_grad and t.grad_fn is not None:
        return None
    if t.is_conj() or t.is_neg():
        return None
    data = t.detach().contiguous()
    dtype = str(data.dtype).removeprefix("torch.")
    as_np = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dtype)
    try:
        arr = (data.view(getattr(torch, as_np)) if as_np else data).numpy()
    except (TypeError, RuntimeError):
        return None
    is_param = type(t) is not torch.Tensor
    return _rebuild_tensor, (pickle.PickleBuffer(arr.reshape(-1).view("uint8")) if arr.size else b"",
                             dtype, tuple(data.shape), bool(t.requires_grad), is_param)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
                    is_param: bool) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf)) else \
        torch.empty(0, dtype=torch.uint8)
    t = raw.view(tdtype).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pieces:
    """A pickle's output as the pieces the pickler writes, kept, not copied: the pickler hands
    a large ``bytes`` value (which no pickling hook sees: pickle always writes it in band) to
    ``write`` as the object itself, so it travels without a copy on this side, like an
    out-of-band buffer."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: Any) -> int:
        self.pieces.append(data if type(data) is bytes else bytes(data))
        return len(self.pieces[-1])


def dumps_parts(obj: Any, *, sources: bool = False) -> list[Any]:
    """Pickle ``obj`` into the parts of one message: header, pickle, then aligned buffers.

    ``sources``: code pickled by value carries its source lines, for remote tracebacks.
    """
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        if memoryview(buf).nbytes < _OOB_MIN:
            return True  # serialize in band
        buffers.append(buf)
        return False

    stream = _Pieces()
    (_SourcePickler if sources else _Pickler)(stream, protocol=5, buffer_callback=keep).dump(obj)
    body = stream.pieces
    plen = sum(len(b) for b in body)
    raws = [b.raw() for b in buffers]
    lens = [r.nbytes for r in raws]
    head = _HEAD.pack(MAGIC, PROTOCOL_VERSION, len(raws), plen) + struct.pack(f"<{len(raws)}Q", *lens)
    parts: list[Any] = [head, *body]
    offset = len(head) + plen
    for raw in raws:
        pad = _pad(offset)
        if pad:
            parts.append(b"\0" * pad)
        parts.append(raw)
        offset += pad + raw.nbytes
    return parts


def dumps(obj: Any, *, sources: bool = False) -> bytes:
    """One message as bytes (small messages; large ones should use :func:`dumps_parts`)."""
    parts = dumps_parts(obj, sources=sources)
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)


def parts_size(parts: Iterable[Any]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def loads(data: Any) -> Any:
    """Decode one message; out-of-band buffers are views of ``data`` (no copies)."""
    body, bufs = split(data)
    return pickle.loads(body, buffers=bufs)


def split(data: Any) -> tuple[memoryview, list[memoryview]]:
    """Check a message's framing (magic, version, buffer table, sizes) without unpickling it:
    the pickle stream and the out-of-band buffers. Raises ProtocolError."""
    view = memoryview(data).cast("B")
    if view.nbytes < _HEAD.size:
        raise ProtocolError(f"message truncated: {view.nbytes} bytes, header needs {_HEAD.size}")
    magic, version, nbufs, plen = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError("not a ktlite message (bad magic)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"message protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    pos = _HEAD.size
    if nbufs > 1 << 20 or view.nbytes < pos + 8 * nbufs:
        raise ProtocolError("message truncated in its buffer table")
    lens = struct.unpack_from(f"<{nbufs}Q", view, pos)
    pos += 8 * nbufs
    body = view[pos:pos + plen]
    pos += plen
    bufs = []
    for n in lens:
        pos += _pad(pos)
        if pos + n > view.nbytes:
            raise ProtocolError(f"message truncated: buffer of {n} bytes runs past the end ({view.nbytes})")
        bufs.append(view[pos:pos + n])
        pos += n
    if body.nbytes != plen:
        raise ProtocolError("message truncated in its pickle stream")
    return body, bufs


# ---- frames -------------------------------------------------------------------------------

def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def frame_parts(kind: int, parts: list[Any]) -> list[Any]:
    return [FRAME.pack(kind, parts_size(parts)), *parts]


def log_frame(rank: int, pod: str, stream: str, text: str) -> bytes:
    return frame(LOG, json.dumps([rank, pod, stream, text]).encode())


def error_frame(kind: str, message: str) -> bytes:
    return frame(ERROR, json.dumps({"type": kind, "message": message}).encode())


def notice_frame(kind: str, message: str, **fields: Any) -> bytes:
    """Something the caller should know while the call runs: ``waiting`` (pods the coordinator
    cannot reach yet, by index in ``pods``), or ``skip`` (frames dropped: the stream goes on
    at frame ``to``; a skip notice is not counted as a frame itself)."""
    return frame(NOTICE, json.dumps({"kind": kind, "message": message, **fields}).encode())


class FrameParser:
    """Incremental frame parser: ``feed`` chunks, get complete ``(kind, payload)`` frames.

    Each payload lands in its own bytearray, so messages decoded from it are writable and
    zero-copy.
    """

    def __init__(self) -> None:
        self._head = bytearray()
        self._payload: bytearray | None = None
        self._kind = 0
        self._got = 0

    @property
    def mid_frame(self) -> bool:
        return bool(self._head) or self._payload is not None

    def feed(self, chunk: Any) -> list[tuple[int, bytearray]]:
        out: list[tuple[int, bytearray]] = []
        view = memoryview(chunk).cast("B")
        pos = 0
        while pos < view.nbytes:
            if self._payload is None:
                need = FRAME.size - len(self._head)
                self._head += view[pos:pos + need]
                pos += min(need, view.nbytes - pos)
                if len(self._head) < FRAME.size:
                    break
                self._kind, length = FRAME.unpack(self._head)
                self._head.clear()
                if length > MAX_FRAME:
                    raise ProtocolError(f"a frame claims {length} bytes, more than the {MAX_FRAME} a "
                                        "ktlite peer sends: not a ktlite stream, or a corrupt one")
                self._payload, self._got = bytearray(length), 0
            take = min(len(self._payload) - self._got, view.nbytes - pos)
            self._payload[self._got:self._got + take] = view[pos:pos + take]
            self._got += take
            pos += take
            if self._got == len(self._payload):
                out.append((self._kind, self._payload))
                self._payload = None
        if self._payload is not None and self._got == len(self._payload):
            out.append((self._kind, self._payload))
            self._payload = None
        return out


def read_frames(chunks: Iterable[Any]) -> Iterator[tuple[int, bytearray]]:
    """Frames from an iterator of byte chunks; raises ProtocolError if it ends mid-frame."""
    parser = FrameParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    if parser.mid_frame:
        raise ProtocolError("stream ended inside a frame")


def gather_parts(outcomes: list[tuple[int, str, str, Any, str, float]], started: bool = True) -> list[Any]:
    """Encode per-rank outcomes ``(rank, pod, status, data, message, at)``; data stays opaque;
    ``at`` is the wall-clock time the outcome was known (the earliest failure is the cause).
    ``started=False`` tells the caller that no rank started (the call may be sent again).

    ``data`` is the encoded value, None, or ``("shm", path, size)`` when the value waits in
    a shared-memory file for a caller on the same host.
    """
    def wrap(data: Any) -> Any:
        return data if data is None or isinstance(data, tuple) else pickle.PickleBuffer(data)
    return dumps_parts({"outcomes": [(rank, pod, status, wrap(data), message, at)
                                     for rank, pod, status, data, message, at in outcomes],
                        "started": started})


def chunked(parts: Iterable[Any], size: int = 4 << 20) -> Iterator[memoryview]:
    """Split parts into chunks of at most ``size`` bytes without copying."""
    for part in parts:
        mv = memoryview(part).cast("B")
        for i in range(0, mv.nbytes, size):
            yield mv[i:i + size]


def bearer(token: str) -> str:
    return f"Bearer {token}"
