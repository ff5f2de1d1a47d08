"""The frame stream ``POST /call`` answers with: ``kind:u8 length:u64 payload`` frames, logs
interleaved with the final result, so a caller sees every rank's output live.

Payloads: a log line and a notice are JSON, a result is a :class:`ktlite_wire.outcome.CallResult`
message, an error a :class:`ktlite_wire.errors.WireError` as JSON, a heartbeat empty.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ktlite_wire import landing
from ktlite_wire.envelope import parts_size
from ktlite_wire.errors import ErrorCode, ProtocolError, WireError

FRAME = struct.Struct("<BQ")
MAX_FRAME = 64 << 30  # no result frame is larger; a bigger claim is corruption, not data
JOIN_MAX = 1 << 20  # frames up to this size travel in one piece (larger: in parts, not copied)


class FrameKind(IntEnum):
    LOG = 1
    RESULT = 2
    ERROR = 3
    HEARTBEAT = 4
    NOTICE = 5


LOG, RESULT, ERROR, HEARTBEAT, NOTICE = (
    FrameKind.LOG,
    FrameKind.RESULT,
    FrameKind.ERROR,
    FrameKind.HEARTBEAT,
    FrameKind.NOTICE,
)


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def frame_item(kind: int, parts: list[Any]) -> bytes | list[Any]:
    """One frame of ``parts``, sized once: joined into one ``bytes`` when it is small (then
    whoever keeps, counts or sends it reads its length), else its parts (large buffers are
    not copied)."""
    size = parts_size(parts)
    head = FRAME.pack(kind, size)
    if size <= JOIN_MAX:
        return head + b"".join(parts)
    return [head, *parts]


@dataclass(frozen=True)
class LogLine:
    """One line a rank wrote: ``stream`` is ``out`` or ``err``."""

    rank: int
    pod: str
    stream: str
    text: str

    def encode(self) -> bytes:
        return frame(LOG, json.dumps([self.rank, self.pod, self.stream, self.text]).encode())

    @classmethod
    def decode(cls, payload: Any) -> LogLine:
        try:
            rank, pod, stream, text = json.loads(bytes(payload))
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"a log frame must be [rank, pod, stream, text]: {e}") from None
        return cls(int(rank), str(pod), str(stream), str(text))


@dataclass(frozen=True)
class Notice:
    """Something the caller should know while the call runs: ``waiting`` (pods the
    coordinator cannot reach yet, by index in ``pods``), or ``skip`` (frames dropped: the
    stream goes on at frame ``to``; a skip notice is not counted as a frame itself)."""

    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return frame(
            NOTICE, json.dumps({**self.fields, "kind": self.kind, "message": self.message}).encode()
        )

    @classmethod
    def decode(cls, payload: Any) -> Notice:
        try:
            data = json.loads(bytes(payload))
        except ValueError as e:
            raise ProtocolError(f"a notice frame is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ProtocolError("a notice frame must be a JSON object")
        kind, message = str(data.pop("kind", "")), str(data.pop("message", ""))
        return cls(kind, message, data)

    def as_dict(self) -> dict[str, Any]:
        return {**self.fields, "kind": self.kind, "message": self.message}


def log_frame(rank: int, pod: str, stream: str, text: str) -> bytes:
    return LogLine(rank, pod, stream, text).encode()


def notice_frame(kind: str, message: str, **fields: Any) -> bytes:
    return Notice(kind, message, fields).encode()


def error_frame(error: WireError) -> bytes:
    return frame(ERROR, json.dumps(error.encode()).encode())


def decode_error(payload: Any) -> WireError:
    try:
        data = json.loads(bytes(payload))
    except ValueError:
        return WireError(ErrorCode.INTERNAL, bytes(payload).decode(errors="replace")[:2000])
    return WireError.decode(data)


class FrameParser:
    """Incremental frame parser: ``feed`` chunks, get complete ``(kind, payload)`` frames.

    Each payload lands in memory of its own, so messages decoded from it are writable and
    zero-copy: a ``bytearray`` that grows with the bytes that arrive, or for a payload over
    :data:`JOIN_MAX` an anonymous private mapping of its length (``ktlite_wire.landing``: a
    warm one from ``landings`` when given), whose pages the kernel provides only as bytes
    land in them. Either way a header that claims gigabytes costs
    nothing until they come. A reader with a socket can read a large payload straight into
    its memory: :meth:`room` is where the next bytes go, :meth:`filled` says they came.
    """

    def __init__(self, landings: landing.Landings | None = None) -> None:
        self.landings = landings
        self._head = bytearray()
        self._payload: bytearray | None = None
        self._big: memoryview | None = None  # a large payload's mapping
        self._at = 0  # bytes of the large payload so far
        self._kind = 0
        self._need = 0  # bytes of the current payload still to come

    @property
    def mid_frame(self) -> bool:
        return bool(self._head) or self._payload is not None or self._big is not None

    def where(self) -> str:
        """Where in the stream the parser is, for an error: how much of which frame came."""
        if self._big is not None:
            return f"{self._at} of the {self._at + self._need} bytes of a frame"
        if self._payload is not None:
            return f"{len(self._payload)} of the {len(self._payload) + self._need} bytes of a frame"
        if self._head:
            return f"{len(self._head)} bytes of a frame's header"
        return "between frames"

    def room(self) -> memoryview | None:
        """The rest of a large payload's memory, to read into (then :meth:`filled`); None
        between frames and in a small frame: give those bytes to :meth:`feed`."""
        if self._big is None:
            return None
        return self._big[self._at :]

    def due(self) -> int:
        """How many bytes :meth:`feed` takes before the parser knows more (the rest of a
        frame's header, or of a small payload): a reader that reads no more than that at a
        time reads every large payload through :meth:`room`, none of it through ``feed``."""
        if self._payload is not None:
            return self._need
        return FRAME.size - len(self._head)

    def filled(self, n: int) -> list[tuple[int, Any]]:
        """``n`` bytes were read into :meth:`room`: the frame, once it is complete."""
        if self._big is None or not 0 <= n <= self._need:
            raise ValueError(f"filled({n}) with {self._need} payload bytes due")
        self._at += n
        self._need -= n
        if self._need:
            return []
        done, self._big = self._big, None
        return [(self._kind, done)]

    def _start(self, length: int) -> None:
        if length > JOIN_MAX:
            try:
                self._big = (
                    self.landings.take(length)
                    if self.landings is not None
                    else memoryview(landing.fresh(length))
                )
                self._at, self._need = 0, length
                return
            except (OSError, OverflowError, ValueError):
                pass  # no address space for it: grow a bytearray as bytes come
        self._payload, self._need = bytearray(), length

    def feed(self, chunk: Any) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        view = memoryview(chunk).cast("B")
        pos, end = 0, view.nbytes
        while pos < end:
            if self._big is not None:
                take = min(self._need, end - pos)
                self._big[self._at : self._at + take] = view[pos : pos + take]
                pos += take
                out += self.filled(take)
                continue
            if self._payload is None:
                need = FRAME.size - len(self._head)
                self._head += view[pos : pos + need]
                pos += min(need, end - pos)
                if len(self._head) < FRAME.size:
                    break
                self._kind, length = FRAME.unpack(self._head)
                self._head.clear()
                if length > MAX_FRAME:
                    raise ProtocolError(
                        f"a frame claims {length} bytes, more than the {MAX_FRAME} a "
                        "ktlite peer sends: not a ktlite stream, or a corrupt one"
                    )
                self._start(length)
                if self._big is not None:
                    continue
            payload = self._payload
            assert payload is not None  # started above, or by an earlier feed
            take = min(self._need, end - pos)
            if take:
                payload += view[pos : pos + take]
                self._need -= take
                pos += take
            if not self._need:
                out.append((self._kind, payload))
                self._payload = None
        return out


def read_frames(
    chunks: Iterable[Any], landings: landing.Landings | None = None
) -> Iterator[tuple[int, Any]]:
    """Frames from an iterator of byte chunks; raises ProtocolError if it ends mid-frame."""
    parser = FrameParser(landings)
    for chunk in chunks:
        yield from parser.feed(chunk)
    if parser.mid_frame:
        raise ProtocolError("stream ended inside a frame")
