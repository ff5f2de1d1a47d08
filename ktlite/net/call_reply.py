"""A call's reply: the frame stream a coordinator pod answers a call with (heartbeats, the
ranks' log lines, notices, then the result), read into per-rank outcomes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ktlite.errors import KtliteError, PodUnreachable
from ktlite_wire import landing
from ktlite_wire.frames import (
    ERROR,
    HEARTBEAT,
    LOG,
    NOTICE,
    RESULT,
    LogLine,
    Notice,
    decode_error,
    read_frames,
)
from ktlite_wire.outcome import RankOutcome, ReadResult

logger = logging.getLogger(__name__)

LogSink = Callable[[int, str, str, str], None]  # (rank, pod, stream, text)


NoticeSink = Callable[[dict[str, Any]], None]


Outcomes = list[RankOutcome]


class CallReply:
    """A call's per-rank outcomes; ``started=False`` when no rank started (safe to send
    again). Read lazily: :meth:`values` gives a call whose every rank returned a value
    without a record per rank; :attr:`outcomes` builds the records."""

    def __init__(self, result: ReadResult) -> None:
        self._result = result
        self.started = result.started

    @property
    def outcomes(self) -> Outcomes:
        return self._result.outcomes

    def values(self) -> list[Any] | None:
        """Every rank's encoded value in rank order; None unless every rank returned one."""
        return self._result.values()

    @property
    def held(self) -> int:
        """How many ranks may still map the call's argument file (``ktlite_wire.argfiles``)."""
        return self._result.held

    def all_ok(self) -> bool:
        """Every rank returned a value."""
        return self._result.all_ok()


class FrameReader:
    """Reads a call's frame stream: prints logs, passes notices on, returns the result; counts
    the frames read so that a broken stream can be re-attached where it stopped."""

    def __init__(self, on_log: LogSink | None, on_notice: NoticeSink | None, url: str) -> None:
        self.on_log, self.on_notice, self.url = on_log, on_notice, url
        self.seen = 0

    def read(self, chunks: Any) -> CallReply:
        """Reads the stream to its end (it ends right after the result) so the connection can
        be reused."""
        return self.take(read_frames(chunks, landing.caller()))

    def take(self, frames: Iterator[tuple[int, Any]]) -> CallReply:
        """:meth:`read`, from the stream's frames (``Connection.frames`` reads them)."""
        result = None
        for kind, payload in frames:
            if kind == HEARTBEAT:
                continue
            if kind == NOTICE:
                notice = Notice.decode(payload)
                if notice.kind == "skip":
                    self.seen = int(notice.fields["to"])
                    logger.warning(
                        "%s while the connection to the pod was re-established", notice.message
                    )
                    continue
                if self.on_notice is not None:
                    self.on_notice(notice.as_dict())
            elif kind == LOG:
                if self.on_log is not None:
                    line = LogLine.decode(payload)
                    self.on_log(line.rank, line.pod, line.stream, line.text)
            elif kind == RESULT:
                result = CallReply(ReadResult(payload))
            elif kind == ERROR:
                err = decode_error(payload)
                raise KtliteError(
                    f"pod at {self.url} failed the call: {err.type_name or err.code}: {err.message}"
                )
            self.seen += 1
        if result is None:
            raise PodUnreachable(
                f"the coordinator pod at {self.url} ended the call without a result"
            )
        return result
