"""Concurrent calls (``Compute(concurrency=K)``), ``async def`` targets, and the FIFO order
of a distributed deployment's calls, on real pod servers and rank processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.specs.deployment_spec import DeploymentSpec

MEET_S = 60.0  # how long a call waits for the others it should run beside


def _meet(place: str, n: int) -> None:
    """Until ``n`` calls have arrived at ``place`` (a directory): only calls that run at once all
    get past it. Proves concurrency without a stopwatch (a loaded machine stretches any)."""
    Path(place, uuid.uuid4().hex).touch()
    deadline = time.monotonic() + MEET_S
    while (here := len(os.listdir(place))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {here} of {n} calls were running at once after {MEET_S:g} s")
        time.sleep(0.02)


def nap(seconds: float, fail: bool = False, meet: tuple[str, int] | None = None) -> dict:
    start = time.time()
    if meet is not None:
        _meet(*meet)
    for _ in range(int(seconds / 0.05)):  # short sleeps: an interrupt lands between them
        time.sleep(0.05)
    if fail:
        raise KeyError("this call fails on its own")
    return {"pid": os.getpid(), "start": start, "thread": threading.get_ident()}


async def async_nap(seconds: float) -> dict:
    await asyncio.sleep(seconds)
    return {"rank": int(os.environ.get("RANK", "0")), "loop": id(asyncio.get_running_loop())}


class Server:
    def __init__(self) -> None:
        self.order: list[int] = []

    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()

    async def meet(self, place: str, n: int) -> int:
        """As ``_meet``, on the rank's event loop."""
        Path(place, uuid.uuid4().hex).touch()
        deadline = time.monotonic() + MEET_S
        while (here := len(os.listdir(place))) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {here} of {n} async calls were running at once after {MEET_S:g} s"
                )
            await asyncio.sleep(0.02)
        return os.getpid()

    def record(self, i: int) -> int:
        time.sleep(0.15)
        self.order.append(i)
        return i

    def get_order(self) -> list[int]:
        return self.order

    def die(self) -> None:
        time.sleep(0.3)
        os._exit(3)


def _parallel(n: int, fn, *args) -> tuple[list, float]:
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = (
            [pool.submit(fn, *a) for a in args] if args else [pool.submit(fn) for _ in range(n)]
        )
        done = [f.exception() or f.result() for f in futures]
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def napper():
    remote = kt.fn(nap).to(kt.Compute(concurrency=4), name="conc-nap")
    yield remote
    remote.teardown()


def test_concurrency_is_validated_and_defaults_by_kind() -> None:
    with pytest.raises(kt.ConfigError, match="concurrency"):
        kt.Compute(concurrency=0)
    with pytest.raises(kt.ConfigError, match="concurrency"):
        kt.Compute(concurrency=True)
    single_cls = DeploymentSpec(name="a", pod=kt.Compute().pod_spec(), kind="cls")
    dist_cls = DeploymentSpec(
        name="a", pod=kt.Compute().distribute("pytorch", workers=2).pod_spec(), kind="cls"
    )
    single_fn = DeploymentSpec(name="a", pod=kt.Compute().pod_spec(), kind="fn")
    assert (single_cls.concurrency, dist_cls.concurrency, single_fn.concurrency) == (8, 1, 1)
    assert (
        DeploymentSpec(name="a", pod=kt.Compute(concurrency=3).pod_spec(), kind="fn").concurrency
        == 3
    )
    # not a pod-shaping field: changing it reloads code, it does not replace pods
    assert (
        DeploymentSpec("a", kt.Compute(concurrency=2).pod_spec()).pod_hash()
        == DeploymentSpec("a", kt.Compute().pod_spec()).pod_hash()
    )


def test_four_sync_calls_run_at_once_on_concurrency_4(napper, tmp_path) -> None:
    results, _ = _parallel(4, lambda: napper(0.0, meet=(str(tmp_path), 4)))
    assert all(isinstance(r, dict) for r in results), results  # all four met: they ran at once
    assert len({r["pid"] for r in results}) == 1  # one rank process ...
    assert len({r["thread"] for r in results}) == 4  # ... four threads


def test_one_failing_call_does_not_fail_its_neighbours(napper) -> None:
    results, _ = _parallel(4, lambda a: napper(0.5, fail=a), (False,), (True,), (False,), (False,))
    assert isinstance(results[1], KeyError)
    assert [isinstance(r, dict) for r in results] == [True, False, True, True]


def test_timeout_of_one_call_leaves_the_others_running(napper) -> None:
    def short(_: int) -> dict:
        return napper(1.5)

    def doomed(_: int) -> dict:
        return napper.options(timeout=0.5)(30.0)

    results, took = _parallel(3, lambda f: f(0), (short,), (doomed,), (short,))
    assert isinstance(results[1], kt.CallTimeout), results[1]
    assert isinstance(results[0], dict) and isinstance(results[2], dict), results
    assert took < 30.0, took  # the others did not wait for the doomed call's 30 s nap
    assert napper(0.0)["pid"] == results[0]["pid"]  # the rank process was not killed


def test_async_method_on_a_single_rank_class_defaults_to_8_at_once(tmp_path) -> None:
    remote = kt.cls(Server).to(kt.Compute(), name="conc-async-cls")
    try:
        assert remote.deployment.spec.concurrency == 8
        place = tmp_path
        results, _ = _parallel(4, lambda: remote.meet(str(place), 4))
        assert all(isinstance(r, int) for r in results), results  # all four met: they ran at once
        assert len(set(results)) == 1
    finally:
        remote.teardown()


def test_rank_death_fails_every_call_on_it() -> None:
    remote = kt.cls(Server).to(kt.Compute(concurrency=4), name="conc-death")
    try:

        def slow() -> int:
            return remote.slow(20.0)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(slow) for _ in range(3)]
            deadline = time.monotonic() + 60
            while len(remote.status()[0]["active_calls"]) < 3:  # all three run on the rank
                assert time.monotonic() < deadline, (
                    f"3 calls were not running after 60 s: {remote.status()}"
                )
                time.sleep(0.05)
            killer = pool.submit(remote.die)
            errors = [f.exception(timeout=60) for f in [*running, killer]]
        assert all(isinstance(e, kt.RankDied) for e in errors), errors
        assert remote.slow(0.0) > 0  # the next call gets a fresh rank process
    finally:
        remote.teardown()


def test_async_function_on_a_distributed_deployment() -> None:
    remote = kt.fn(async_nap).to(
        kt.Compute().distribute("pytorch", workers=2), name="conc-async-dist"
    )
    try:
        assert [r["rank"] for r in remote(0.1)] == [0, 1]
        # the rank's event loop lives on between calls
        loops = [r["loop"] for r in remote(0.0)]
        assert loops == [r["loop"] for r in remote(0.0)]
    finally:
        remote.teardown()


def test_distributed_calls_run_one_at_a_time_in_arrival_order() -> None:
    remote = kt.cls(Server).to(kt.Compute().distribute("pytorch", workers=2), name="conc-fifo")
    try:
        assert remote.deployment.spec.concurrency == 1
        threads = []
        for i in range(6):  # one caller thread per call; call i arrives once call i-1 is queued
            queued = threading.Event()

            def call(i: int = i, queued: threading.Event = queued) -> None:
                future = remote.record.submit(i)
                queued.set()
                future.result(timeout=60)

            t = threading.Thread(target=call)
            t.start()
            threads.append(t)
            assert queued.wait(60), f"call {i} was not queued after 60 s"
        for t in threads:
            t.join(60)
        orders = remote.get_order()
        assert orders[0] == orders[1] == list(range(6)), orders
    finally:
        remote.teardown()


def test_to_takes_concurrency_too(tmp_path) -> None:
    remote = kt.fn(nap).to(kt.Compute(), name="conc-to-form", concurrency=3)
    try:
        assert remote.deployment.spec.concurrency == 3 and remote.compute.concurrency == 3
        results, _ = _parallel(3, lambda: remote(0.0, meet=(str(tmp_path), 3)))
        assert all(isinstance(r, dict) for r in results), results  # all three met: they ran at once
        assert len({r["thread"] for r in results}) == 3
    finally:
        remote.teardown()
    with pytest.raises(kt.ConfigError, match="between 1 and 1024"):
        kt.fn(nap).to(kt.Compute(), name="conc-to-bad", concurrency=0)
