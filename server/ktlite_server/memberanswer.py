"""Pod 0's side of a member's ``RUN`` (``memberrun``) on a link that is open: the member's
answer read as its messages arrive and handed to the coordinator's ``sink`` (its ranks'
outcomes) the moment it is whole, without a task, a future, a context manager and an async
iterator per member and call (``Coordinator._remote``, the general path, takes a link still to
be opened, a relay, a per-rank call and a large body).

The answer reads as ``_remote`` reads one: log frames passed on to the caller as they come; a
refusal (``NOT_DEPLOYED``, ``REDEPLOYED``: ``stale``) or an error frame fails the pod's ranks;
its ``DONE`` gives its outcomes (decoded as far as the pod 0's result needs: their rows),
a ``RESULT`` frame a large one's, passed on undecoded; silence past the silence timeout and a
broken link fail them at once, naming the pod. A link that said ``GOAWAY`` before any answer
came never ran the call: it is sent again the general way (which opens a new link).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ktlite_server import linkclient
from ktlite_server.linkresponse import LinkStream
from ktlite_server.peers import PeerError, PeerPool, PeerTimeout, error_text
from ktlite_wire import frames, linkframes
from ktlite_wire.errors import ErrorCode, ProtocolError
from ktlite_wire.outcome import RankOutcome, Subtree
from ktlite_wire.status import Status

Answer = list[RankOutcome] | Subtree
# (message, status, lost): the pod's ranks' outcomes made up for a failure; ``lost``: its
# stream broke (no use sending it a stop)
Failed = Callable[[str, Status, bool], list[RankOutcome]]
_STALE = (ErrorCode.NOT_DEPLOYED, ErrorCode.REDEPLOYED)


def send(
    peers: PeerPool,
    url: str,
    name: str,
    fields: bytes,
    body: memoryview,
    silence_s: float,
    emit: Callable[[Any], None],
    failed: Failed,
    again: Callable[[], Awaitable[Answer]],
    sink: Callable[[Answer], None],
) -> MemberAnswer | None:
    """Send pod ``url`` its ``RUN`` over the pool's open link to it; its answer goes to
    ``sink``, once. None when there is no open link to it, the link is paused, or the body is
    large (then the general path sends it)."""
    link = linkclient.open_link(peers, url)
    if link is None or link.paused or body.nbytes > linkclient.BODY_MAX:
        return None
    answer: MemberAnswer = link.open_stream(
        lambda lk, n: MemberAnswer(lk, n, silence_s, name, emit, failed, again, sink)
    )
    link.transport.writelines(linkframes.run_message(answer.stream, fields, [body]))
    return answer


class MemberAnswer(LinkStream):
    """One member's answer to a ``RUN``, fed by the link: its outcomes go to ``sink`` once
    (:attr:`settled`). Its silence is the link's to watch (``PeerLink``): no timer per member
    and call."""

    watched_by_link = True

    def __init__(
        self,
        link: linkclient.PeerLink,
        stream: int,
        silence_s: float,
        name: str,
        emit: Callable[[Any], None],
        failed: Failed,
        again: Callable[[], Awaitable[Answer]],
        sink: Callable[[Answer], None],
    ) -> None:
        super().__init__(link, stream, silence_s)
        self._sink = sink
        self.settled = False  # its answer went to the sink (or the coordinator gave it up)
        self._name = name
        self._emit = emit
        self._failed = failed
        self._again = again
        self._parser: frames.FrameParser | None = None
        self._result: Subtree | None = None
        self._heard = False  # any message of the answer came
        self.done: memoryview | None = None  # its DONE
        self._sent_again: asyncio.Future[Answer] | None = None

    def _resolve(self, answer: Answer) -> None:
        if not self.settled:
            self.settled = True
            self.release()  # a stream still open (an error frame, or a stop) is closed
            self._sink(answer)

    def cancel(self) -> None:
        """The coordinator stops waiting (a stop's grace ran out): the stream is closed, a
        call sent again is abandoned, and nothing goes to the sink."""
        if not self.settled:
            self.settled = True
            self.release()
            if self._sent_again is not None:
                self._sent_again.cancel()

    def _lost(self, message: str) -> None:
        self._resolve(self._failed(message, Status.DIED, True))

    # -- fed by the link ----------------------------------------------------------------

    def head(self, status: int, code: str, body: bytes) -> None:
        """Only a refused RUN has a head."""
        self._heard = True
        self._ended = True  # a refusal ends the stream
        stale = ErrorCode.parse(code) in _STALE
        message = f"pod {self._name} answered HTTP {status}: {error_text(body)}"
        self._resolve(self._failed(message, Status.STALE if stale else Status.DIED, False))

    def data(self, payload: memoryview) -> None:
        self._heard = True
        if self.settled:
            return
        if self._parser is None:
            self._parser = frames.FrameParser()
        try:
            for kind, data in self._parser.feed(payload):
                if kind == frames.LOG:
                    self._emit(frames.frame(frames.LOG, bytes(data)))
                elif kind == frames.RESULT:  # a large result's: its head read, passed on
                    self._result = Subtree.peek(data)
                elif kind == frames.ERROR:
                    err = frames.decode_error(data)
                    self._resolve(
                        self._failed(f"pod {self._name}: {err.message}", Status.DIED, False)
                    )
                    return
        except ProtocolError as e:
            self._lost(f"lost the connection to pod {self._name} during the call: {e}")

    def finish(self, done: memoryview) -> None:
        self._heard = True
        self.done = done
        self.end()
        try:
            self._resolve(linkframes.read_done(done))
        except ProtocolError as e:
            self._lost(f"lost the connection to pod {self._name} during the call: {e}")

    def end(self) -> None:
        self._ended = True
        if self.done is None and not self.settled:
            self._resolve(
                self._result
                if self._result is not None
                else self._failed(
                    f"pod {self._name} closed the call's stream without a result",
                    Status.DIED,
                    False,
                )
            )

    def fail(self, error: PeerError) -> None:
        if self.settled or self._ended:
            return
        if isinstance(error, PeerTimeout):
            self._lost(
                f"pod {self._name} stopped responding (no data or heartbeat for "
                f"{self._timeout:g}s); the pod may have died or be overloaded"
            )
        elif not self._heard and self.link.goaway:
            # the pod closed the link, idle, before it read the call: nothing ran, send again
            self._sent_again = asyncio.ensure_future(self._again())
            self._sent_again.add_done_callback(self._chained)
        else:
            self._lost(f"lost the connection to pod {self._name} during the call: {error}")

    def _chained(self, again: asyncio.Future[Answer]) -> None:
        if again.cancelled() or self.settled:
            return
        error = again.exception()
        if error is not None:  # the general path failed itself (it reports a pod's failures)
            self._lost(f"sending the call to pod {self._name} again failed: {error!r}")
        else:
            self._resolve(again.result())
