"""The recent calls of one pod: a bounded ring that ``GET /status`` answers with
(``recent_calls``), for ``ktlite dashboard``'s call list and per-call timeline.

One entry per call this pod ran, written once when the call's outcome is known
(:meth:`PodCalls.run <ktlite_server.podcalls.PodCalls.run>`): the call id, when it reached
this pod and when it ended here, and per rank when its outcome was known, how it ended and,
for a rank that raised, its exception as the rank encoded it (opaque bytes: the pod server
never unpickles; the caller decodes them as it decodes a call's error). Recording costs a
tuple per rank; the values ranks returned are never kept. The ring holds at most
``MAX_CALLS`` calls and ``ERRORS_MAX`` bytes of errors (the oldest calls go first); a rank's
error over ``ERROR_MAX`` bytes is not kept (``error_dropped``).
"""

from __future__ import annotations

import base64
import collections
import time
from typing import TYPE_CHECKING, Any

from ktlite_wire.status import Status

if TYPE_CHECKING:
    from ktlite_server.localcall import CallHandle

MAX_CALLS = 32
ERROR_MAX = 16 * 1024  # one rank's encoded exception (its traceback text and its pickle)
ERRORS_MAX = 256 * 1024  # every kept error together
MESSAGE_MAX = 2000  # a rank's message (a death's exit and last stderr lines)

# (rank, status, when its outcome was known (epoch s), message, encoded error or None, dropped)
_Rank = tuple[int, Status, float, str, bytes | None, bool]
# (call id, reached this pod (monotonic s), ended here (monotonic s), ranks, error bytes)
_Entry = tuple[str, float, float, list[_Rank], int]


_OK = Status.OK


def _failed(o: Any) -> _Rank:
    data = o.data
    size = 0 if data is None else memoryview(data).nbytes
    kept = bytes(data) if o.status is Status.ERROR and 0 < size <= ERROR_MAX else None
    dropped = o.status is Status.ERROR and kept is None
    return (o.rank, o.status, o.at, o.message[:MESSAGE_MAX], kept, dropped)


class CallHistory:
    """The last ``max_calls`` calls this pod ran (see the module's docstring)."""

    def __init__(self, max_calls: int = MAX_CALLS, errors_max: int = ERRORS_MAX) -> None:
        self.max_calls = max_calls
        self.errors_max = errors_max
        self._ring: collections.deque[_Entry] = collections.deque()
        self._error_bytes = 0

    def __len__(self) -> int:
        return len(self._ring)

    def record(self, handle: CallHandle) -> None:
        """Keep call ``handle`` (ended now) with its ranks' outcomes."""
        ranks: list[_Rank] = []
        errors = 0
        for o in handle.outcomes:  # a call's cost: one tuple per rank
            if o.status is _OK:
                ranks.append((o.rank, _OK, o.at, "", None, False))
            else:
                failed = _failed(o)
                errors += len(failed[4] or b"")
                ranks.append(failed)
        ring = self._ring
        ring.append((handle.call_id, handle.started, time.monotonic(), ranks, errors))
        self._error_bytes += errors
        while len(ring) > self.max_calls or (self._error_bytes > self.errors_max and len(ring) > 1):
            self._error_bytes -= ring.popleft()[4]

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept calls, oldest first, as JSON-ready objects (times in epoch seconds)."""
        offset = time.time() - time.monotonic()
        return [
            {
                "id": call_id,
                "start": round(started + offset, 6),
                "end": round(ended + offset, 6),
                "ranks": [
                    {
                        "rank": rank,
                        "status": status.value,
                        "end": round(at, 6),
                        "message": message,
                        "error": None if error is None else base64.b64encode(error).decode(),
                        "error_dropped": dropped,
                    }
                    for rank, status, at, message, error, dropped in ranks
                ],
            }
            for call_id, started, ended, ranks, _ in self._ring
        ]
