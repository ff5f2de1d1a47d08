"""A large result is sent while its rank still writes it (issue 26, item 5): the rank answers
the call at once (``rankchannel.Result(streaming=True)``), writes its shared-memory file in
pieces and says how far it got (``rankchannel.Written``); the pod server sends each piece
once it is written (``ktlite_server.resultfeed``).

At the server's edge (a real uvicorn with the pod server's protocol, plain and TLS, the
caller's own lean connection): the first piece reaches the caller before the rest is
written, and a rank that dies mid-write cuts the response off mid-frame, so the caller gets
an error, never a truncated result. End to end (real pods on the local backend, over HTTP
and over shared memory): tens of MB intact (SHA-256), and a rank that dies mid-write is an
error naming what happened, in seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ktlite as kt
from ktlite.net.client import PodClient
from ktlite.net.connection import Pool
from ktlite_server import resultfeed
from ktlite_server.calls import StreamResponse
from ktlite_server.streams import CallStream
from ktlite_wire import envelope, frames, landing, rankchannel, shm
from ktlite_wire.frames import RESULT, frame_item
from ktlite_wire.outcome import CallResult, RankOutcome
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status
from tests.test_bulk_data import TOKEN, Served
from tests.test_bulk_data import serve as serve  # noqa: F401  (the fixture: plain and TLS)

SIZE = 4 * resultfeed.PIECE


def test_the_rank_channel_carries_a_streaming_result_and_its_progress() -> None:
    result = rankchannel.Result("c1", True, None, "/dev/shm/ktlite-res-x", SIZE, streaming=True)
    got = rankchannel.decode(envelope.join(rankchannel.encode(result))[rankchannel.LEN.size :])
    assert isinstance(got, rankchannel.Result) and got.streaming and got.size == SIZE
    plain = rankchannel.Result("c1", True, b"v", None, 1)
    got = rankchannel.decode(envelope.join(rankchannel.encode(plain))[rankchannel.LEN.size :])
    assert isinstance(got, rankchannel.Result) and not got.streaming
    for msg in (rankchannel.Written("c1", 5 << 20), rankchannel.Written("c1", 7, "disk full")):
        parts = rankchannel.encode(msg)
        assert rankchannel.decode(envelope.join(parts)[rankchannel.LEN.size :]) == msg


def test_write_into_reports_every_piece() -> None:
    fd, path = shm.create(shm.RESULT_PREFIX, 10)
    seen: list[int] = []
    try:
        assert os.fstat(fd).st_size == 10  # a reader may map all of it at once
        assert shm.write_into(fd, [b"abc", memoryview(b"defghij")], 4, seen.append) == 10
        assert os.pread(fd, 10, 0) == b"abcdefghij"
    finally:
        os.close(fd)
        os.unlink(path)
    assert seen == [4, 8, 10]


class Growing:
    """A result file a test writes piece by piece, as a rank would, behind a served call."""

    def __init__(self) -> None:
        self.value = os.urandom(SIZE)
        self.fd, self.path = shm.create(shm.RESULT_PREFIX, SIZE)
        self.feed = resultfeed.Feed(rank=0, size=SIZE)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stream: CallStream | None = None
        self.started = threading.Event()

    def app(self) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            self.loop = asyncio.get_running_loop()
            view = resultfeed.take(self.path, SIZE, self.feed)
            outcome = RankOutcome(0, "pod-0", Status.OK, view, "", 0.0)
            self.stream = stream = CallStream("c1", 0.0, lambda: None)
            stream.emit(frame_item(RESULT, CallResult([outcome]).encode()))
            stream.finish()
            self.started.set()
            await StreamResponse(stream, 0)(scope, receive, send)

        return app

    def write(self, start: int, end: int) -> None:
        """Write bytes [start, end) of the value and tell the server, as ``Written`` does."""
        os.pwrite(self.fd, self.value[start:end], start)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.feed.advance, end)

    def fail(self, error: str) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.feed.fail, error)

    def close(self) -> None:
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture
def growing() -> Iterator[Growing]:
    g = Growing()
    yield g
    g.close()


def _head_size() -> int:
    """Bytes of the result frame before the value: the frame's head and the envelope's."""
    outcome = RankOutcome(0, "pod-0", Status.OK, memoryview(bytearray(SIZE)), "", 0.0)
    return envelope.parts_size(frame_item(RESULT, CallResult([outcome]).encode())) - SIZE


def test_the_first_piece_reaches_the_caller_before_the_rest_is_written(serve, growing) -> None:
    served: Served = serve(growing.app())
    pool = Pool()
    try:
        conn, status, headers = pool.post(
            served.url, "/call", {}, [b""], 10.0, 30.0, served.context
        )
        assert status == 200 and growing.started.wait(30)
        growing.write(0, resultfeed.PIECE)  # the rank's first piece, and nothing more yet
        pieces = conn.body(headers)  # pieces of at most 1 MiB, each read whole
        got = bytearray()
        pre = _head_size()
        # what arrives now was sent before the rest was written (a read timeout otherwise)
        while len(got) + (1 << 20) <= pre + resultfeed.PIECE:
            got += next(pieces)
        assert bytes(got[pre:]) == growing.value[: len(got) - pre]
        growing.write(resultfeed.PIECE, SIZE)
        for piece in pieces:
            got += piece
        pool.release(conn)
    finally:
        pool.close()
    ((kind, payload),) = frames.read_frames([got])
    data = CallResult.decode(payload).outcomes[0].data
    assert (
        kind == RESULT and hashlib.sha256(data).digest() == hashlib.sha256(growing.value).digest()
    )
    assert not os.path.exists(growing.path)  # taken: unlinked, the mapping holds the pages


def test_a_rank_dying_mid_write_cuts_the_stream_off(serve, growing) -> None:
    served: Served = serve(growing.app())
    client = PodClient(TOKEN)
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(client.call(served.url, CallPlan(id="c1"), [b""], None))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert growing.started.wait(30)
        growing.write(0, resultfeed.PIECE)
        growing.fail("rank process was killed by SIGKILL")
        caller.join(30)
    finally:
        client.forget(served.url)
    assert not caller.is_alive(), "the caller still waits 30 s after the rank died"
    (error,) = outcome
    assert isinstance(error, kt.PodUnreachable), error  # never a result
    assert "of the 16777" in str(error) and "bytes of a frame" in str(error), error
    # a caller that attaches again reads the cause where the result was
    assert growing.stream is not None
    kind, payload = next(iter(frames.read_frames([growing.stream.frames[0]])))
    assert kind == frames.ERROR
    message = frames.decode_error(payload).message
    assert "rank 0's result" in message and "SIGKILL" in message


def test_a_stalled_rank_fails_its_result() -> None:
    async def main() -> str:
        feed = resultfeed.Feed(rank=3, size=10)
        feed.advance(4)
        await feed.until(4, stall_s=0.05)  # written already: no wait
        with pytest.raises(resultfeed.ResultLost) as info:
            await feed.until(10, stall_s=0.05)
        return str(info.value)

    message = asyncio.run(main())
    assert "rank 3" in message and "after 4 bytes" in message and "wrote nothing" in message


# ---- end to end: real pods on the local backend ----------------------------------------------


def give(n: int, die: bool = False) -> Any:
    """``n`` random bytes as an array; ``die``: the rank process dies after writing the first
    piece of its result file (as a rank killed mid-write would)."""
    import os

    import numpy as np

    if die:
        from ktlite_wire import shm

        def half(fd: int, parts: list[Any], piece: int, progress: Callable[[int], None]) -> int:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            os.pwrite(fd, data[:piece], 0)
            progress(piece)
            os._exit(3)

        shm.write_into = half
    return np.frombuffer(np.random.default_rng(11).bytes(n), dtype=np.uint8).copy()


@pytest.fixture(scope="module", params=["plain", "tls"])
def remote(request: pytest.FixtureRequest) -> Iterator[Any]:
    tls = request.param == "tls"
    r = kt.fn(give, name=f"resultstream-{request.param}").to(
        kt.Compute(cpus=1, tls=tls, stream_logs=False)
    )
    yield r
    r.teardown()


def _expected(n: int) -> bytes:
    return hashlib.sha256(np.random.default_rng(11).bytes(n)).digest()


@pytest.mark.parametrize("road", ["http", "shm"])
def test_tens_of_megabytes_come_back_intact(remote, monkeypatch, road) -> None:
    monkeypatch.setenv("KTLITE_SHM", "0" if road == "http" else "1")
    n = 40 << 20
    warm = landing.caller().reused
    for _ in range(3):
        got = remote(n)
        assert got.nbytes == n and hashlib.sha256(got).digest() == _expected(n)
        assert got.flags.writeable
        del got  # let go: its memory receives the next result
    if road == "http":  # the caller's warm memory took the later results
        assert landing.caller().reused >= warm + 2


@pytest.mark.parametrize("road", ["http", "shm"])
def test_a_rank_dying_mid_write_is_an_error_not_a_result(remote, monkeypatch, road) -> None:
    monkeypatch.setenv("KTLITE_SHM", "0" if road == "http" else "1")
    with pytest.raises(kt.KtliteError) as info:
        remote(20 << 20, die=True)
    text = str(info.value)
    if road == "shm":  # the pod server saw it: the rank's death, and how far it wrote
        assert "lost after" in text and "exited with code 3" in text, text
    else:  # the response was cut off mid-frame
        assert "bytes of a frame" in text and "lost" in text, text
    got = remote(3 << 20)  # the rank is replaced; the next call runs
    assert hashlib.sha256(got).digest() == _expected(3 << 20)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def test_a_result_into_warm_memory_raises_no_peak(remote, monkeypatch) -> None:
    """The client holds a received result once, in memory it keeps: a second result of the
    same size, after the first is let go, lands there and raises the client's peak RSS by
    (almost) nothing; a result still held is never overwritten."""
    monkeypatch.setenv("KTLITE_SHM", "0")
    n = 48 << 20
    first = remote(n)
    kept = first[:16].copy()
    del first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the RSS now
    base = _status_kb("VmRSS")
    got = remote(n)
    rise = (_status_kb("VmHWM") - base) << 10
    assert hashlib.sha256(got).digest() == _expected(n)
    assert rise < n // 4, f"peak RSS rose {rise >> 20} MiB receiving {n >> 20} MiB"
    held = remote(n)  # lands in fresh memory: ``got`` still holds the warm one
    assert np.array_equal(got[:16], kept) and np.array_equal(held[:16], kept)


def fail_or_stop_loudly() -> None:
    """Rank 1 fails; rank 0, stopped by it, raises an error over 1 MiB (a file of its own)."""
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails")
    try:
        time.sleep(60)
    except BaseException:
        raise RuntimeError("x" * (2 << 20)) from None


def _result_files() -> set[str]:
    return {n for n in os.listdir(shm.shm_dir()) if n.startswith(shm.RESULT_PREFIX)}


def test_a_stopped_rank_s_large_error_leaves_no_file() -> None:
    r = kt.fn(fail_or_stop_loudly, name="resultstream-stopped").to(
        kt.Compute(cpus=1, stream_logs=False).distribute("spmd", workers=1, num_proc=2)
    )
    try:
        before = _result_files()
        with pytest.raises(kt.KtliteError, match="rank 1 fails"):
            r()
        deadline = time.monotonic() + 10
        while _result_files() - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _result_files() - before  # other tests' files come and go; this one stayed
    finally:
        r.teardown()
