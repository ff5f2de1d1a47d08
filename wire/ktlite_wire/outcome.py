"""How a call (or a deploy) ended on each rank: the message a pod answers with.

A rank's value stays opaque bytes (a ``ktlite_wire.codec`` message, or the pickled
:class:`~ktlite_wire.errors.RemoteExceptionInfo` of what it raised) carried in a buffer; the
header says who, how and when. Pods pass each other's outcomes on without unpickling them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.status import Status

_STATUSES: dict[Any, Status] = {s.value: s for s in Status}
_new = tuple.__new__
_OK = Status.OK
_BY_RANK = operator.itemgetter(0)  # a RankOutcome's rank


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


class Subtree(NamedTuple):
    """A pod's whole answer to a call it relayed, as it sent it: the encoded
    :class:`CallResult` (passed on untouched, decoded by the caller alone) and what its
    relay needs of it, read from the message's head (its own rows, not its subtree's).
    ``head`` and ``bufs``: the head and buffers of a small answer with no subtrees of its
    own (a leaf pod's), which the relay lifts into its own result (:meth:`CallResult.encode`)
    rather than nesting it: the caller then reads one message per relay, not one per pod."""

    data: memoryview
    failed: int | None  # the lowest rank below it that failed of its own (Status.failed)
    not_ok: int  # how many of its outcomes are not OK
    head: dict[str, Any] | None = None
    bufs: list[memoryview] | None = None

    @classmethod
    def peek(cls, data: Any) -> Subtree:
        """The summary of an encoded result, its subtrees' rows left undecoded. Raises
        ProtocolError for a malformed head (the rows are checked by whoever decodes them)."""
        header, bufs = envelope.decode(data, "call result")
        failed, not_ok = header.get("failed"), header.get("not_ok")
        if (failed is not None and type(failed) is not int) or type(not_ok) is not int:
            raise ProtocolError(
                f"a relayed call result needs 'failed' (a rank or null) and 'not_ok' (a count), "
                f"got {failed!r} and {not_ok!r}"
            )
        view = memoryview(data).cast("B")
        rows, runs = header.get("outcomes"), header.get("runs") or []
        if (
            not header.get("subtrees")
            and type(rows) is list
            and type(runs) is list
            and len(rows) + len(runs) <= LIFT_MAX
        ):
            return cls(view, failed, not_ok, header, bufs)
        return cls(view, failed, not_ok)


# a child's answer of at most this many rows and runs (a leaf pod's: one run for its 8 ranks
# that returned a value) is lifted into its relay's result, a larger one nested untouched: a
# relay's work per call stays bounded by its children, whatever their ranks. Small: lifting
# costs the relay about what it saves the caller per entry, and pod 0, on every call's path,
# should not lift its relays' answers (32 children x 8 pods at 256 pods)
LIFT_MAX = 4
MAX_NESTING = 32  # relays within relays; a deeper claim is corruption (a tree has ~log N)
# a value this small that every rank of a run sent alike travels once: below the codec's
# out-of-band size (4096), so each rank's copy decoded from it shares no memory with another's
SAME_MAX = 4096

# a run of values: consecutive ranks of one pod that each returned a value, their buffers in a row
Run = tuple[int, int, str, list[Any]]  # first rank, count, pod, each rank's value's buffer


@dataclass
class CallResult:
    """Every outcome of a call on the pods that answer; ``started=False`` tells the caller
    that no rank started (the call may be sent again). A relay's result carries its own
    ranks' outcomes and, untouched, the results its children relayed (``subtrees``): the
    caller decodes them all (:class:`ReadResult`), no pod between."""

    outcomes: list[RankOutcome]
    started: bool = True
    subtrees: list[Subtree] = field(default_factory=list)
    held: int = 0  # this pod's ranks that may still map the call's argument file (argfiles)

    def summary(self) -> tuple[int | None, int]:
        """The lowest rank that failed of its own (None: none), and how many outcomes are not
        OK, over this result and its subtrees."""
        # (``failed`` is a Python call: asked only of those not OK)
        failed = [o.rank for o in self.outcomes if o.status is not _OK and o.status.failed]
        failed += [s.failed for s in self.subtrees if s.failed is not None]
        not_ok = sum(1 for o in self.outcomes if o.status is not _OK)
        return (min(failed) if failed else None), not_ok + sum(s.not_ok for s in self.subtrees)

    def encode(self) -> list[Any]:
        """The message's parts (values are not copied). Header fields:

        - ``runs``: ranks that returned a value, as ``[first rank, count, pod, first buffer,
          buffers]`` for each run of consecutive ranks of one pod (their values in
          consecutive buffers), so a pod's 8 ranks are one entry and its caller builds no
          record per rank; ``buffers`` is 1 when every rank of the run sent the same bytes
          (at most :data:`SAME_MAX`: a ``None`` from each rank travels once per pod), else
          ``count``;
        - ``outcomes``: every other outcome, a JSON list ``[rank, pod, status, message, at,
          buffer index or null, [shm path, size] or null]`` (``at`` is 0 for a value: only a
          failure's time is read, and a float's shortest text costs more than the rest);
        - ``subtrees``: a relay's children's results, as they came (buffer indexes), and
          ``failed`` / ``not_ok``, the summary its own relay reads (:class:`Subtree`);
        - ``held`` (absent when 0): how many of its own ranks may still map the call's
          argument file (``ktlite_wire.argfiles``)."""
        rows: list[list[Any]] = []
        runs: list[list[Any]] = []  # [first rank, count, pod, the values], laid out below
        buffers: list[Any] = []
        run: list[Any] = [-2, 0, "", []]  # the open run (none yet)
        for o in self.outcomes:
            data, status = o.data, o.status
            if status is _OK and data is not None and type(data) is not ShmRef:
                if o.rank == run[0] + run[1] and o.pod == run[2]:
                    run[1] += 1
                    run[3].append(data)
                else:
                    run = [o.rank, 1, o.pod, [data]]
                    runs.append(run)
                continue
            buf, shm = None, None
            if isinstance(data, ShmRef):
                shm = [data.path, data.size]
            elif data is not None:
                buf = len(buffers)
                buffers.append(data)
            at = 0 if status is _OK else o.at
            rows.append([o.rank, o.pod, status, o.message, at, buf, shm])  # str enum: JSON value
        for run in runs:
            values = run[3]
            first = values[0]
            same = len(values) > 1 and memoryview(first).nbytes <= SAME_MAX
            same = same and values.count(first) == len(values)  # (compared in C)
            run[3] = len(buffers)
            run.append(1 if same else len(values))
            buffers += [first] if same else values
        failed, not_ok = self.summary()
        header: dict[str, Any] = {"outcomes": rows, "started": self.started}
        header["failed"], header["not_ok"] = failed, not_ok
        held, nested = self.held, []
        for s in self.subtrees:
            if s.head is None or s.bufs is None or not _lift(s.head, s.bufs, rows, runs, buffers):
                nested.append(s)
            else:  # a lifted child's count is this result's (a malformed one: held)
                count = s.head.get("held", 0)
                held += count if type(count) is int and count >= 0 else 1
        if runs:
            header["runs"] = runs
        if held:
            header["held"] = held
        if nested:
            header["subtrees"] = list(range(len(buffers), len(buffers) + len(nested)))
            buffers += [s.data for s in nested]
        return envelope.encode(header, buffers)

    def encode_bytes(self) -> bytes:
        return envelope.join(self.encode())

    @classmethod
    def decode(cls, data: Any) -> CallResult:
        """Decode a result, its subtrees' outcomes with its own, in rank order; values are
        views of ``data`` (writable when ``data`` is)."""
        read = ReadResult(data)
        return cls(read.outcomes, read.started)


def _lift(
    head: dict[str, Any],
    bufs: list[memoryview],
    rows: list[Any],
    runs: list[Any],
    buffers: list[Any],
) -> bool:
    """Add a small child answer's rows, runs and buffers to a result being encoded (its
    buffer indexes moved past ``buffers``); False, nothing added, when its head is not as
    this wire writes it (then it is nested as it came, and the caller says what is wrong)."""
    base = len(buffers)
    try:
        mine = [
            [*row[:5], None if row[5] is None else base + row[5], row[6]]
            for row in head["outcomes"]
        ]
        theirs = [[*run[:3], base + run[3], run[4]] for run in head.get("runs") or []]
    except (TypeError, IndexError, KeyError):
        return False
    rows += mine
    runs += theirs
    buffers += bufs
    return True


class ReadResult:
    """A call result as the caller reads it: its subtrees' rows and runs of values gathered
    in one pass over the nested messages, the per-rank records (:attr:`outcomes`) built only
    when asked. A call whose every rank returned a value needs none: :meth:`values`.
    Raises ProtocolError for a malformed result."""

    def __init__(self, data: Any) -> None:
        self.rows: list[RankOutcome] = []
        self.runs: list[Run] = []
        held = [0]
        self.started = _read_into(data, self.rows, self.runs, 0, held)
        # how many ranks may still map the call's argument file, over every pod
        self.held = held[0]
        self._outcomes: list[RankOutcome] | None = None

    @classmethod
    def of(cls, outcomes: list[RankOutcome]) -> ReadResult:
        """One pod's outcomes as a result read (a ``RUN``'s ``DONE``: ``linkframes.read_done``):
        every rank started, none maps the call's argument file (a ``RUN`` has none)."""
        read = cls.__new__(cls)
        read.rows, read.runs, read.started, read.held, read._outcomes = [], [], True, 0, None
        for o in outcomes:
            data = o.data
            if o.status is _OK and data is not None and type(data) is not ShmRef:
                read.runs.append((o.rank, 1, o.pod, [data]))
            else:
                read.rows.append(o)
        return read

    def all_ok(self) -> bool:
        """Every outcome is a value (none failed, was stopped or not reached)."""
        return all(o.status is _OK for o in self.rows)

    def values(self) -> list[Any] | None:
        """Every rank's encoded value in rank order, when every outcome is a value carried
        in the message (no failure, no shared-memory file); else None."""
        if self.rows:
            return None
        runs = self.runs
        if any(runs[k][0] > runs[k + 1][0] for k in range(len(runs) - 1)):
            runs = sorted(runs, key=_BY_RANK)
        out: list[Any] = []
        end = -1  # the rank after the last run's
        for first, count, _pod, bufs in runs:
            if first < end:  # a rank twice: the records say which value wins
                return None
            out += bufs
            end = first + count
        return out

    @property
    def outcomes(self) -> list[RankOutcome]:
        """Every outcome, in rank order."""
        if self._outcomes is None:
            outs = list(self.rows)
            for first, _count, pod, bufs in self.runs:
                outs += [
                    _new(RankOutcome, (first + k, pod, _OK, buf, "", 0))
                    for k, buf in enumerate(bufs)
                ]
            outs.sort(key=_BY_RANK)  # runs of ranks in order: timsort merges them in linear time
            self._outcomes = outs
        return self._outcomes


def _read_into(
    data: Any, rows: list[RankOutcome], runs: list[Run], depth: int, held: list[int]
) -> bool:
    """Append one encoded result's outcomes (and its subtrees') to ``rows`` and ``runs``, and
    add its ``held`` to ``held[0]``; returns its ``started``."""
    header, bufs = envelope.decode(data, "call result")
    count = header.get("held", 0)
    if type(count) is not int or count < 0:
        raise ProtocolError(f"a call result's held must be a count, got {str(count)[:40]}")
    held[0] += count
    listed = header.get("outcomes")
    if not isinstance(listed, list):
        raise ProtocolError("a call result needs a list of outcomes")
    statuses, nbufs, append = _STATUSES, len(bufs), rows.append
    for row in listed:  # a row per rank that did not return a value
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
            append(_new(RankOutcome, (rank, pod, st, data_, message, at)))
        except (ValueError, TypeError, IndexError) as e:
            raise ProtocolError(f"a malformed outcome {str(row)[:200]}: {e}") from None
    listed = header.get("runs") or []
    if not isinstance(listed, list):
        raise ProtocolError(f"a call result's runs must be a list, got {str(listed)[:200]}")
    for run in listed:  # a run per pod whose ranks all returned a value
        try:
            first, count, pod, buf, n = run
            if not (
                type(first) is int
                and type(count) is int
                and type(pod) is str
                and type(buf) is int
                and count > 0
                and (n == 1 or n == count)
                and type(n) is int
                and 0 <= buf <= nbufs - n
            ):
                raise ValueError(f"it names buffers {buf!r}+{n!r} of {nbufs}")
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"a malformed run of values {str(run)[:200]}: {e}") from None
        runs.append((first, count, pod, [bufs[buf]] * count if n == 1 else bufs[buf : buf + n]))
    subtrees = header.get("subtrees") or []
    if not isinstance(subtrees, list):
        raise ProtocolError(f"a call result's subtrees must be a list, got {subtrees!r}")
    if subtrees and depth >= MAX_NESTING:
        raise ProtocolError(f"a call result nests subtrees deeper than {MAX_NESTING} relays")
    for index in subtrees:
        sub = envelope.buffer(bufs, index, "a call result's subtree")
        if sub is None:
            raise ProtocolError("a call result's subtree names no buffer")
        _read_into(sub, rows, runs, depth + 1, held)
    return bool(header.get("started", True))
