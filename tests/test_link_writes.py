"""A pod's end of a link (``ktlite_server.linkserver``) writes what is due together: the heads
of the calls that came in one read leave in one write, before any of those calls' own work
runs; the answers that end in one turn of the loop leave in one write. A recording transport
counts the writes; the calls are the pod server's ``CallStream``s."""

from __future__ import annotations

import asyncio
from typing import Any

from ktlite_server.calls import StreamResponse
from ktlite_server.linkserver import LinkServer
from ktlite_server.streams import CallStream
from ktlite_wire import frames, linkframes


class Recorder:
    """A transport that keeps each write's messages, and what ran between them."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def writelines(self, parts: list[Any]) -> None:
        reader = linkframes.Reader()
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        self.events.append(("write", [(k, s) for k, s, _ in reader.feed(data)]))

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def _scenario(late_heads: bool) -> list[Any]:
    async def scenario() -> list[Any]:
        events: list[Any] = []
        streams: dict[str, CallStream] = {}

        async def serve(request: Any) -> StreamResponse:
            meta = request.headers["x-ktlite-call"]
            stream = streams[meta] = CallStream(meta, 0.0, lambda: None)

            async def work() -> None:  # the call's own work: what a pod's ranks are handed
                events.append(("work", meta))

            asyncio.get_running_loop().create_task(work())
            return StreamResponse(stream, 0)

        link = LinkServer(Recorder(events), serve, 1 << 20, 75.0, late_heads=late_heads)
        link.data_received(
            b"".join(
                b"".join(
                    bytes(p) for p in linkframes.call_message(s, f"call {s}", [memoryview(b"x")])
                )
                for s in (1, 2, 3)
            )
        )
        for _ in range(5):
            await asyncio.sleep(0)
        for stream in streams.values():  # three answers in one turn
            stream.emit(frames.frame(frames.RESULT, b"value"))
            stream.finish()
        for _ in range(5):
            await asyncio.sleep(0)
        link.connection_lost(None)
        return events

    return asyncio.run(scenario())


def test_heads_and_answers_that_are_due_together_leave_in_one_write() -> None:
    events = _scenario(late_heads=False)
    head, data, end = linkframes.HEAD, linkframes.DATA, linkframes.END
    assert events == [
        ("write", [(head, 1), (head, 2), (head, 3)]),
        ("work", "call 1"),
        ("work", "call 2"),
        ("work", "call 3"),
        ("write", [(data, 1), (end, 1), (data, 2), (end, 2), (data, 3), (end, 3)]),
    ]


def test_a_callers_link_sends_each_head_with_its_answer() -> None:
    # a caller's link (?heads=late): one write of the three answers, each with its head
    events = _scenario(late_heads=True)
    head, data, end = linkframes.HEAD, linkframes.DATA, linkframes.END
    assert events == [
        ("work", "call 1"),
        ("work", "call 2"),
        ("work", "call 3"),
        ("write", [(k, s) for s in (1, 2, 3) for k in (head, data, end)]),
    ]
