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


class ShmRef(NamedTuple):
    """A value waiting in a shared-memory file for a caller on the same host."""

    path: str
    size: int


class RankOutcome(NamedTuple):
    """One rank's outcome; ``at`` is the wall-clock time it was known (the earliest failure is
    the cause). ``data``: the encoded value (or exception info), None, or a :class:`ShmRef`."""

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
        """The message's parts (values are not copied)."""
        rows: list[dict[str, Any]] = []
        buffers: list[Any] = []
        for o in self.outcomes:
            row: dict[str, Any] = {
                "rank": o.rank,
                "pod": o.pod,
                "status": Status(o.status).value,
                "message": o.message,
                "at": o.at,
            }
            if isinstance(o.data, ShmRef):
                row["shm"] = [o.data.path, o.data.size]
            elif o.data is not None:
                row["buf"] = len(buffers)
                buffers.append(o.data)
            rows.append(row)
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
        for row in rows:
            if not isinstance(row, dict):
                raise ProtocolError("an outcome must be a JSON object")
            try:
                rank, at = row["rank"], float(row.get("at", 0.0))
                if isinstance(rank, bool) or not isinstance(rank, int) or not math.isfinite(at):
                    raise ValueError(f"rank {rank!r} at {at!r}")
                status = Status.parse(row["status"])
                shm = row.get("shm")
                data_: Any = (
                    ShmRef(str(shm[0]), int(shm[1]))
                    if shm is not None
                    else envelope.buffer(bufs, row.get("buf"), f"rank {rank}'s outcome")
                )
                outs.append(
                    RankOutcome(
                        rank, str(row["pod"]), status, data_, str(row.get("message", "")), at
                    )
                )
            except (KeyError, ValueError, TypeError, IndexError) as e:
                raise ProtocolError(f"a malformed outcome {str(row)[:200]}: {e}") from None
        return cls(outs, bool(header.get("started", True)))
