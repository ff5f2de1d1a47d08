"""A call's per-rank outcomes as values in rank order, or one error naming every failed rank
(its pod, its traceback; the rank's own exception type where it unpickles here)."""

from __future__ import annotations

import contextlib
import operator
from typing import Any

from ktlite.errors import (
    CallCancelled,
    CallTimeout,
    DeployError,
    NotDeployedError,
    QuorumTimeout,
    RankDied,
    RankFailure,
    RemoteError,
    RemoteException,
    with_remote_context,
)
from ktlite_wire import codec, shm
from ktlite_wire.errors import ProtocolError
from ktlite_wire.outcome import RankOutcome, ShmRef
from ktlite_wire.status import Status

_BY_RANK = operator.itemgetter(0)  # a RankOutcome's rank

# a failed rank's kind -> the error that reports it ("error" keeps the rank's own exception)
KIND_ERRORS: dict[str, type[RemoteError]] = {
    Status.DIED: RankDied,
    Status.UNREACHABLE: QuorumTimeout,
    Status.TIMEOUT: CallTimeout,
    Status.CANCELLED: CallCancelled,
}


def take_shared(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """The outcomes with each value a pod handed over in a shared-memory file mapped here (and
    the file removed). Every file is taken, so none is left behind, before a path that names
    no ktlite shared-memory file (or a link) is refused: :class:`ProtocolError`, naming it."""
    taken: list[RankOutcome] = []
    refused: Exception | None = None
    for o in outcomes:
        if isinstance(o.data, ShmRef):
            try:
                o = o._replace(data=shm.take(o.data.path, o.data.size))
            except (ProtocolError, OSError) as e:
                refused = refused or ProtocolError(
                    f"rank {o.rank} (pod {o.pod}) handed over its value in {o.data.path!r}, "
                    f"which cannot be taken: {e}"
                )
        taken.append(o)
    if refused is not None:
        raise refused
    return taken


def decode_values(blobs: list[Any]) -> list[Any] | None:
    """The encoded values of a call's ranks (``CallReply.values``), decoded; None when one
    does not decode here (then :func:`split` names that rank and the error). A value equal
    to the one before it, of an immutable type, is decoded once: a call that returns None
    on 8,000 ranks unpickles one None."""
    values: list[Any] = []
    append, loads = values.append, codec.loads
    prev: Any = None
    value: Any = None
    for data in blobs:
        if prev is not None and (data is prev or data == prev):  # the same immutable value
            append(value)
            continue
        try:
            value = loads(data)
        except Exception:  # noqa: BLE001 - split names the rank and the error
            return None
        prev = data if type(value) in _SHARED_TYPES else None
        append(value)
    return values


# values of these types are immutable: one decoded object may stand for several ranks' equal
# encoded values
_SHARED_TYPES = (type(None), bool, int, float, complex, str, bytes)


def split(outcomes: list[RankOutcome]) -> tuple[list[RankFailure], dict[int, Any]]:
    failures: list[RankFailure] = []
    values: dict[int, Any] = {}
    outcomes = take_shared(outcomes)
    for rank, pod, status, data, message, at in sorted(outcomes, key=_BY_RANK):
        if status is Status.OK:
            try:
                values[rank] = codec.loads(data) if data is not None else None
            except Exception as e:  # noqa: BLE001
                failures.append(
                    RankFailure(
                        rank,
                        pod,
                        Status.ERROR,
                        f"its result could not be unpickled here: {type(e).__name__}: {e}",
                        exception=e,
                        at=at,
                    )
                )
        elif status is Status.ERROR:
            info = codec.loads(data)
            exc: BaseException | None = None
            if info.pickled is not None:
                with contextlib.suppress(Exception):
                    exc = codec.loads(info.pickled)
            failures.append(
                RankFailure(
                    rank,
                    pod,
                    Status.ERROR,
                    f"{info.type_name}: {info.message}",
                    traceback=info.traceback,
                    exception=exc,
                    at=at,
                )
            )
            if exc is None:
                failures[-1].exception = RemoteException(
                    f"rank {rank} on pod {pod} raised {info.type_name}: {info.message}",
                    type_name=info.type_name,
                    remote_traceback=info.traceback,
                )
        else:
            failure = RankFailure(rank, pod, status, message, at=at)
            # outcomes hold a value or an exception for every rank
            failure.exception = (
                NotDeployedError(failure.describe())
                if status is Status.STALE
                else KIND_ERRORS.get(status, RemoteError)(failure.describe(), failures=[failure])
            )
            failures.append(failure)
    return failures, values


def to_error(
    failures: list[RankFailure], values: dict[int, Any], what: str, base: type[Exception]
) -> BaseException:
    primary = [
        f
        for f in failures
        if f.kind in (Status.ERROR, Status.DIED, Status.UNREACHABLE, Status.STALE)
    ] or failures
    collateral = [f for f in failures if f not in primary]
    # the cause is the earliest failure (a peer's "connection reset" comes after the death
    # that caused it), then the lowest rank
    primary.sort(key=lambda f: (f.at or float("inf"), f.rank))
    outcomes: dict[int, Any] = dict(values)
    for f in failures:
        outcomes[f.rank] = f.exception if f.exception is not None else f
    lines = [
        f"{what}: {len(primary)} rank(s) failed: "
        f"{', '.join(str(r) for r in sorted(f.rank for f in primary))}"
    ]
    lines += [f.describe() for f in primary]
    if collateral:
        kinds = sorted({f.kind for f in collateral})
        lines.append(
            f"{' / '.join(kinds)}: rank(s) {', '.join(str(f.rank) for f in collateral)} "
            f"({collateral[0].message})"
        )
    if values:
        lines.append(
            f"finished: rank(s) {', '.join(map(str, sorted(values)))} (their results are on "
            "this error's .results)"
        )
    elif primary[0].kind is Status.TIMEOUT:
        lines.append("no rank finished")
    if primary[0].kind is Status.TIMEOUT:
        lines.append(
            "to try: a longer limit (remote.options(timeout=S) or Compute(call_timeout=S)); "
            "if a rank hangs (a collective some rank never joined), its pod's log "
            "(remote.logs()) shows how far it got"
        )
    summary = "\n".join(lines)
    first = primary[0]
    if first.kind is Status.ERROR and first.exception is not None:
        if isinstance(first.exception, RemoteException):
            first.exception.failures, first.exception.outcomes = failures, outcomes
            first.exception.args = (first.exception.args[0] + "\n" + summary,)
            return first.exception
        return with_remote_context(first.exception, failures, outcomes, summary)
    if base is DeployError:
        return DeployError(summary)
    if first.kind is Status.STALE:
        return NotDeployedError(summary)
    return KIND_ERRORS.get(first.kind, RemoteError)(summary, failures=failures, outcomes=outcomes)
