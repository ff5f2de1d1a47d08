"""``remote.submit`` / ``kt.Future``: queued and running calls, cancel, await, async_=True,
on real local deployments."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

import pytest

import ktlite as kt


def work(x: int, seconds: float = 0.0, fail: bool = False) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    if fail:
        raise ZeroDivisionError(f"work({x}) failed")
    return x * 10 + int(os.environ.get("RANK", "0"))


def takes_async(x: int, async_: bool = False) -> tuple:
    return (x, async_)


class Log:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, i: int, seconds: float = 0.0) -> int:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.02)
        self.seen.append(i)
        return i

    def get(self) -> list[int]:
        return self.seen


@pytest.fixture(scope="module")
def single():
    remote = kt.fn(work).to(kt.Compute(concurrency=4), name="fut-single")
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def log2():
    remote = kt.cls(Log).to(kt.Compute().distribute("pytorch", workers=2), name="fut-log2")
    yield remote
    remote.teardown()


def _wait_running(remote, fut: kt.Future) -> None:
    """Until every pod of ``remote`` runs the call of ``fut`` (bounded)."""
    deadline = time.monotonic() + 60
    while not (
        fut.running() and all(fut.call_id in pod["active_calls"] for pod in remote.status())
    ):
        assert not fut.done(), f"the call ended before it was seen running: {fut!r}"
        assert time.monotonic() < deadline, (
            f"the call of {fut!r} was not running on every pod after 60 s: {remote.status()}"
        )
        time.sleep(0.05)


def test_submit_returns_at_once_and_gives_the_result(single) -> None:
    fut = single.submit(3, 1.0)  # at once: before the call (1 s on the rank) is done
    assert isinstance(fut, kt.Future) and isinstance(fut, concurrent.futures.Future)
    assert not fut.done()
    assert fut.result(timeout=30) == 30
    assert fut.done() and fut.exception() is None
    assert fut.call_id and fut.call_id in repr(fut) and "finished" in repr(fut)


def test_exceptions_keep_their_type(single) -> None:
    fut = single.submit(1, 0.0, True)
    assert isinstance(fut.exception(timeout=30), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError, match=r"work\(1\) failed"):
        fut.result()


def test_as_completed_over_eight_futures(single) -> None:
    futures = [single.submit(i, 0.2) for i in range(8)]
    got = sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=60))
    assert got == [i * 10 for i in range(8)]


def test_await_in_a_running_event_loop(single) -> None:
    async def main() -> list[int]:
        return list(await asyncio.gather(single.submit(1), single.submit(2)))

    assert asyncio.run(main()) == [10, 20]


def test_async_underscore_returns_a_future_unless_the_function_takes_it(single) -> None:
    fut = single(4, async_=True)
    assert isinstance(fut, kt.Future) and fut.result(timeout=30) == 40
    remote = kt.fn(takes_async).to(kt.Compute(), name="fut-takes")
    try:
        assert remote(1, async_=True) == (1, True)  # the user's own parameter
    finally:
        remote.teardown()


def test_futures_on_a_distributed_deployment_run_in_submission_order(log2) -> None:
    futures = [log2.add.submit(i) for i in range(10)]
    assert [f.result(timeout=60) for f in futures] == [[i, i] for i in range(10)]
    seen = log2.get()
    assert seen[0][-10:] == seen[1][-10:] == list(range(10))


def test_cancel_a_queued_future_never_runs_it(log2) -> None:
    before = len(log2.get()[0])
    running = log2.add.submit(100, 1.5)
    queued = log2.add.submit(101)
    assert queued.cancel()
    assert queued.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        queued.result()
    assert running.result(timeout=60) == [100, 100]
    seen = log2.get()[0]
    assert 101 not in seen and seen[before:] == [100]


def test_cancel_a_running_future_stops_its_ranks(log2) -> None:
    fut = log2.add.submit(200, 60.0)
    _wait_running(log2, fut)
    start = time.monotonic()
    assert fut.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(timeout=30)
    assert time.monotonic() - start < 20
    assert fut.cancelled()
    assert log2.add(201) == [201, 201]  # the deployment goes on


def test_teardown_fails_queued_futures() -> None:
    remote = kt.fn(work).to(kt.Compute(), name="fut-teardown")
    first = remote.submit(1, 2.0)
    queued = [remote.submit(i) for i in range(3)]
    _wait_running(remote, first)
    assert not any(f.running() or f.done() for f in queued)  # still queued behind the first
    remote.teardown()
    for f in queued:
        assert isinstance(f.exception(timeout=30), (kt.NotDeployedError, kt.KtliteError))
    first.exception(timeout=30)  # it ended one way or the other: nothing hangs
