"""How a call (or a deploy) ended on each rank: the message a pod answers with.

A rank's value stays opaque bytes (a ``ktlite_wire.codec`` message, or the pickled
:class:`~ktlite_wire.errors.RemoteExceptionInfo` of what it raised) carried in a buffer; the
header says who, how and when. Pods pass each other's outcomes on without unpickling them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.status import Status

_STATUSES: dict[Any, Status] = {s.value: s for s in Status}
_new = tuple.__new__
_OK = Status.OK


class ShmRef(NamedTuple):
    """A value waiting in a shared-memory file for a caller on the same host."""

    path: str
    size: int


class RankOutcome(NamedTuple):
    """One rank's outcome; ``at`` is the wall-clock time a failure was known (the earliest
    failure is the cause; a value's outcome travels with 0). ``data``: the encoded value (or
    exception info), None, or a :class:`ShmRef`."""

    rank: int
    pod: str
    status: Status
    data: Any = None
    message: str = ""
    at: float = 0.0


@dataclass
class CallResult:
    """Every outcome of a call on the pods that answer; ``started=False`` tells the caller
    that no rank started (the call may be sent again)."""

    outcomes: list[RankOutcome]
    started: bool = True

    def encode(self) -> list[Any]:
        """The message's parts (values are not copied). Each outcome is a JSON list, ``[rank,
        pod, status, message, at, buffer index or null, [shm path, size] or null]``: on the
        hot path of every call, cheaper to make and read than an object. ``at`` is 0 for a
        value: only a failure's time is read, and a float's shortest text costs more than the
        rest of the row."""
        rows: list[list[Any]] = []
        buffers: list[Any] = []
        for o in self.outcomes:
            data, buf, shm = o.data, None, None
            if isinstance(data, ShmRef):
                shm = [data.path, data.size]
            elif data is not None:
                buf = len(buffers)
                buffers.append(data)
            at = 0 if o.status is _OK else o.at
            rows.append([o.rank, o.pod, o.status, o.message, at, buf, shm])  # str enum: JSON value
        return envelope.encode({"outcomes": rows, "started": self.started}, buffers)

    def encode_bytes(self) -> bytes:
        return envelope.join(self.encode())

    @classmethod
    def decode(cls, data: Any) -> CallResult:
        """Decode a result; values are views of ``data`` (writable when ``data`` is)."""
        header, bufs = envelope.decode(data, "call result")
        rows = header.get("outcomes")
        if not isinstance(rows, list):
            raise ProtocolError("a call result needs a list of outcomes")
        outs = []
        statuses, nbufs = _STATUSES, len(bufs)
        for row in rows:  # a row per rank: this loop is on the hot path of every call
            try:
                rank, pod, status, message, at, buf, shm = row
                if type(rank) is not int or type(pod) is not str or type(message) is not str:
                    raise ValueError(f"rank {rank!r} of pod {pod!r}")
                if at:  # a failure's time (a value's is 0)
                    at = float(at)
                    if not math.isfinite(at):
                        raise ValueError(f"at {at!r}")
                elif type(at) is not int and type(at) is not float:
                    raise ValueError(f"at {at!r}")
                if shm is not None:
                    data_: Any = ShmRef(str(shm[0]), int(shm[1]))
                elif buf is None:
                    data_ = None
                elif type(buf) is int and 0 <= buf < nbufs:
                    data_ = bufs[buf]
                else:
                    raise ValueError(f"rank {rank}'s outcome names buffer {buf!r} of {nbufs}")
                st = statuses.get(status) or Status.parse(status)
                # tuple.__new__: a NamedTuple's own __new__ is a Python function
                outs.append(_new(RankOutcome, (rank, pod, st, data_, message, at)))
            except (ValueError, TypeError, IndexError) as e:
                raise ProtocolError(f"a malformed outcome {str(row)[:200]}: {e}") from None
        return cls(outs, bool(header.get("started", True)))
