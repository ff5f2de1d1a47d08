"""A call's reply: the frame stream a coordinator pod answers a call with (heartbeats, the
ranks' log lines, notices, then the result), read into per-rank outcomes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ktlite.errors import KtliteError, PodUnreachable
from ktlite.net.connection import ConnectionFailed, ConnectionRefused
from ktlite.net.refusals import raise_for_status
from ktlite_wire import landing, linkframes
from ktlite_wire.errors import ProtocolError
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
from ktlite_wire.headers import ERROR_CODE_HEADER
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
        self.result: CallReply | None = None

    def read(self, chunks: Any) -> CallReply:
        """Reads the stream to its end (it ends right after the result) so the connection can
        be reused."""
        return self.take(read_frames(chunks, landing.caller()))

    def take(self, frames: Iterator[tuple[int, Any]]) -> CallReply:
        """:meth:`read`, from the stream's frames (``Connection.frames`` reads them)."""
        for kind, payload in frames:
            self.frame(kind, payload)
        return self.end()

    def frame(self, kind: int, payload: Any) -> None:
        """One frame of the stream, as it comes (``callmux`` gives them one by one)."""
        if kind == HEARTBEAT:
            return
        if kind == NOTICE:
            notice = Notice.decode(payload)
            if notice.kind == "skip":
                self.seen = int(notice.fields["to"])
                logger.warning(
                    "%s while the connection to the pod was re-established", notice.message
                )
                return
            if self.on_notice is not None:
                self.on_notice(notice.as_dict())
        elif kind == LOG:
            if self.on_log is not None:
                line = LogLine.decode(payload)
                self.on_log(line.rank, line.pod, line.stream, line.text)
        elif kind == RESULT:
            self.result = CallReply(ReadResult(payload))
        elif kind == ERROR:
            err = decode_error(payload)
            raise KtliteError(
                f"pod at {self.url} failed the call: {err.type_name or err.code}: {err.message}"
            )
        self.seen += 1

    def done(self, payload: memoryview) -> None:
        """A ``RUN``'s ``DONE``: the pod's outcomes, the call's result (values are views of
        ``payload``). Raises ProtocolError for a malformed one."""
        self.result = CallReply(ReadResult.of(linkframes.read_done(payload)))

    def end(self) -> CallReply:
        """The call's reply, once its stream ended."""
        if self.result is None:
            raise PodUnreachable(
                f"the coordinator pod at {self.url} ended the call without a result"
            )
        return self.result


def coordinator(url: str, pod: str) -> str:
    """How errors name the coordinator pod ``pod`` at ``url``."""
    return f"coordinator pod {pod} at {url}" if pod else f"the coordinator pod at {url}"


def refused(status: int, body: bytes, url: str, hdrs: dict[str, str]) -> None:
    """Raise the ktlite error of a pod's refusal of a call (its JSON ``detail``)."""
    try:
        detail = str(json.loads(body).get("detail", body))
    except ValueError:
        detail = body.decode(errors="replace")
    raise_for_status(status, detail, url, hdrs.get(ERROR_CODE_HEADER))


def call_error(e: Exception, who: str, silence: float, connect: bool = False) -> Exception:
    """The ktlite error a call's failure ``e`` is to the caller; with ``connect``, a
    connection that could not be opened is one the call never reached (as ``_call_lean``
    says it)."""
    if isinstance(e, KtliteError):
        return e  # already says what happened (PodUnreachable is an OSError too)
    if connect and isinstance(e, ConnectionRefused):
        return PodUnreachable(f"cannot connect to {who}: {e}", delivered=False)
    if isinstance(e, (httpx.ReadTimeout, TimeoutError)):
        return PodUnreachable(
            f"{who} went silent for {silence:g}s during the call (no heartbeat): it probably died"
        )
    if isinstance(e, (httpx.HTTPError, ConnectionFailed, OSError)):
        return PodUnreachable(f"lost the connection to {who}: {e!r}")
    if isinstance(e, ProtocolError):
        return PodUnreachable(f"{who} closed the stream mid-call: {e}")
    return e


def answered(
    frames: FrameReader,
    who: str,
    silence: float,
    done: Callable[[CallReply | None, BaseException | None], None],
) -> Callable[[int, dict[str, str], Any, BaseException | None], None]:
    """What ``callmux`` calls when a call's answer has ended: ``done`` with the reply its
    frames brought, or with the error ``PodClient.call`` would raise."""

    def finished(status: int, hdrs: dict[str, str], body: Any, error: BaseException | None) -> None:
        try:
            if error is not None:
                raise error
            if status >= 400:
                refused(status, body, frames.url, hdrs)
            reply = frames.end()
        except Exception as e:  # noqa: BLE001 - the call's own error, as call() raises it
            failure = call_error(e, who, silence, connect=True)
            if failure is not e:
                failure.__cause__ = e
            done(None, failure)
            return
        done(reply, None)

    return finished
