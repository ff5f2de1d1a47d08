"""A member pod's run of its share of a call that its coordinator fanned out over a peer
link (``linkframes.RUN``): the lean path of the members that relay it to no other pod (a
flat fan-out's, a tree's leaves).

A ``RUN`` carries what a member needs and nothing else (the call id, the launch id, the
process-group generation and port, three flags, the arguments' bytes); the member checks it
as ``POST /call`` checks a call (the code deployed, the same launch, the arguments' framing),
runs it on its ranks (``Pod.run``: admission, a call id runs at
most once, a stop that overtook it) and answers with its ranks' outcomes in one binary
``DONE``; it has no head (a pod that closes an idle link says ``GOAWAY`` first, so the
coordinator knows what never ran: ``linkframes``). There is no call plan to decode, no call stream kept for a re-attach (a member is
never re-attached to: a broken link fails its calls on both ends), no result envelope.
Log lines go as the frame stream's ``DATA`` while it runs, and heartbeats (the link's, for
every call under way: ``LinkServer``); a result in a
shared-memory file that the caller cannot map (another host) goes as a ``RESULT`` frame, as
on the general path. ``CLOSE`` or a broken link stops the call (``Pod.cancel``), as a caller
that disconnects does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ktlite_server import podoutcomes
from ktlite_server.linkserver import LinkServer, send_frames
from ktlite_server.ranks import Outcome, settled
from ktlite_wire import codec, frames, linkframes
from ktlite_wire.errors import ErrorCode, ProtocolError, WireError
from ktlite_wire.outcome import CallResult, RankOutcome
from ktlite_wire.status import Status

if TYPE_CHECKING:
    from ktlite_server.pod import Pod

logger = logging.getLogger(__name__)


class MemberRuns:
    """The ``RUN`` calls this pod gets over its peer links (``LinkServer`` hands each here)."""

    def __init__(self, pod: Pod, max_body: int) -> None:
        self.pod = pod
        self.max_body = max_body

    def __repr__(self) -> str:
        return f"MemberRuns(pod={self.pod.name!r})"

    def start(self, link: LinkServer, stream: int, payload: memoryview) -> None:
        """Check a ``RUN`` and start it, or refuse it on its stream."""
        try:
            run = linkframes.split_run(payload)
        except (ProtocolError, UnicodeDecodeError) as e:
            link.refuse(stream, 400, ErrorCode.BAD_REQUEST.value, f"malformed link run: {e}")
            return
        refusal = self._check(run)
        if refusal is not None:
            link.refuse(stream, *refusal)
            return
        call = self._call(link, stream, run)
        link.begin(stream, call.stop)
        if not call.now():
            asyncio.get_running_loop().create_task(call.run())  # it ends with link.finish

    def _call(self, link: LinkServer, stream: int, run: linkframes.Run) -> _MemberCall:
        """The call a checked ``RUN`` starts (``callerrun`` makes a caller's its own)."""
        return _MemberCall(self.pod, link, stream, run)

    def _check(self, run: linkframes.Run) -> tuple[int, str, str] | None:
        """What ``POST /call`` would refuse of this call: (status, code, detail), or None."""
        pod, body = self.pod, run.body
        if pod.dep is None:
            return (
                409,
                ErrorCode.NOT_DEPLOYED.value,
                f"pod {pod.name} has no code deployed: its server started after the deploy "
                "(a restarted container, a replaced pod); call .to() again, which pushes the "
                "code and reuses the pods",
            )
        if run.launch_id and run.launch_id != pod.dep.launch_id:
            return (
                409,
                ErrorCode.REDEPLOYED.value,
                f"pod {pod.name} runs launch {pod.dep.launch_id}, not the caller's "
                f"{run.launch_id}: it was redeployed since (by another process, or it "
                "restarted); call .to() again",
            )
        if body.nbytes > self.max_body:
            return (
                413,
                ErrorCode.TOO_LARGE.value,
                f"body of {body.nbytes} bytes is larger than this server's limit of "
                f"{self.max_body} bytes (KTLITE_MAX_BODY)",
            )
        try:
            codec.check(body)  # framing only: the server never unpickles user data
        except ProtocolError as e:
            return 400, ErrorCode.BAD_REQUEST.value, f"malformed call body: {e}"
        return None


class _MemberCall:
    """One ``RUN`` on this pod: its log frames while it runs, then its answer."""

    def __init__(self, pod: Pod, link: LinkServer, stream: int, run: linkframes.Run) -> None:
        self.pod = pod
        self.link = link
        self.stream = stream
        self.run_ = run
        self.stopped = False
        self._due: list[bytes] = []  # frames not written yet (written once per loop pass)

    def stop(self) -> None:
        """The coordinator closed the stream, or the link broke: the call is abandoned."""
        if not self.stopped:
            self.stopped = True
            self.pod.cancel(self.run_.call_id, Status.CANCELLED, "the caller disconnected")

    def _emit(self, frame: bytes) -> None:
        if not self._due:
            asyncio.get_running_loop().call_soon(self._flush)
        self._due.append(frame)

    def _flush(self) -> None:
        due, self._due = self._due, []
        if due and not self.stopped:
            size = sum(len(f) for f in due)
            self.link.write([linkframes.header(linkframes.DATA, self.stream, size), *due])

    def _log(self) -> Callable[[int, str, str], None] | None:
        """Where the ranks' log lines go while the call runs: DATA frames (or nowhere)."""
        if not self.run_.flags & linkframes.STREAM_LOGS:
            return None
        name, emit = self.pod.name, self._emit

        def log(rank: int, stream: str, line: str) -> None:
            emit(frames.log_frame(rank, name, stream, line))

        return log

    def _group(self) -> tuple[int, int | None]:
        """The process group's generation and port the call's collectives use: its
        coordinator's choice, sent in the RUN."""
        return self.run_.generation, self.run_.group_port

    def _after(self, outs: list[Outcome]) -> None:
        """The ranks' part of the call ended with ``outs`` (the caller's own call: see
        ``callerrun``)."""

    def now(self) -> bool:
        """Start the call at once, without a task, when this pod need not wait for anything
        (``PodCalls.run_now``: a one-rank pod, idle and well); False: :meth:`run` it."""
        run = self.run_
        if run.flags & linkframes.RESTART:
            return False
        generation, port = self._group()
        return self.pod.run_now(run.call_id, run.body, self._log(), generation, port, self._ran)

    def _ran(self, outs: list[Outcome]) -> None:
        """(:meth:`now`'s) The ranks' outcomes, in the callback that read the rank's reply: the
        DONE written now, unless the answer must wait (a result still written, or large; a
        paused link) or failed to form: then a task answers."""
        self._after(outs)
        answer = None
        if not self.link.paused and all(o.path is None for o in outs):
            try:
                answer = podoutcomes.to_wire(self.pod.name, outs, False)
            except Exception:  # noqa: BLE001 - the task's answer reports it
                answer = None
        if answer is None:
            asyncio.get_running_loop().create_task(self._answer_then_finish(outs))
            return
        try:
            self._write_done(answer)
        finally:
            self.link.finish(self.stream)

    async def run(self) -> None:
        try:
            try:
                outs = await self._ranks(self._log())
            except Exception as e:  # noqa: BLE001 - infrastructure failure: tell the coordinator
                await self._failed(e)
                return
            self._after(outs)
            await self._answer(outs)
        finally:  # its answer is written: the link may close once idle
            self.link.finish(self.stream)

    async def _answer_then_finish(self, outs: list[Outcome]) -> None:
        try:
            await self._answer(outs)
        finally:
            self.link.finish(self.stream)

    async def _failed(self, e: Exception) -> None:
        logger.exception("call %s failed on this pod", self.run_.call_id, exc_info=e)
        error = WireError(ErrorCode.INTERNAL, str(e), type(e).__name__)
        await self._answer_frames([frames.error_frame(error)])

    async def _answer(self, outs: list[Outcome]) -> None:
        """The ranks' outcomes answered: one DONE, or a RESULT frame for a value mapped from
        its rank's file (the caller is on another host)."""
        pod, run = self.pod, self.run_
        shm_results = bool(run.flags & linkframes.SHM_RESULTS)
        try:
            if shm_results:  # the caller maps the files itself: each once its rank wrote it
                outs = await settled(outs)
            answer = podoutcomes.to_wire(pod.name, outs, shm_results)
        except Exception as e:  # noqa: BLE001 - infrastructure failure: tell the coordinator
            await self._failed(e)
            return
        if not shm_results and any(o.path is not None for o in outs):
            # a value mapped from its rank's file (the caller is on another host): a frame of
            # its own, sent as the rank writes it (linkserver's writer), never copied whole
            await self._answer_frames(
                [frames.frame_item(frames.RESULT, CallResult(answer).encode())]
            )
            return
        if self.link.paused:
            self._flush()
            await self.link.drain()
        self._write_done(answer)

    def _write_done(self, answer: list[RankOutcome]) -> None:
        """The log frames still due, then the ``DONE`` (neither once the call was stopped)."""
        self._flush()
        if not self.stopped:
            self._send_done(linkframes.done_message(self.stream, self.pod.name, answer))

    def _send_done(self, parts: list[Any]) -> None:
        """The ``DONE``, now (``callerrun``'s leaves with the others due in this turn)."""
        self.link.write(parts)

    async def _ranks(self, log: Callable[[int, str, str], None] | None) -> list[Outcome]:
        """The call on this pod's ranks, in the process group its coordinator named."""
        run = self.run_
        generation, port = self._group()
        return await self.pod.run(
            run.call_id,
            run.body,
            None,
            log,
            restart=bool(run.flags & linkframes.RESTART),
            generation=generation,
            group_port=port,
        )

    async def _answer_frames(self, items: list[Any]) -> None:
        self._flush()
        if not self.stopped:
            await send_frames(self.link, self.stream, items)
