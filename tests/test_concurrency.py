"""Concurrent calls (``Compute(concurrency=K)``), ``async def`` targets, and the FIFO order
of a distributed deployment's calls, on real pod servers and rank processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time

import pytest

import ktlite as kt
from ktlite.deployment_spec import DeploymentSpec


def nap(seconds: float, fail: bool = False) -> dict:
    start = time.time()
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
        futures = [pool.submit(fn, *a) for a in args] if args else [pool.submit(fn) for _ in range(n)]
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
    single_cls = DeploymentSpec(name="a", compute=kt.Compute(), kind="cls")
    dist_cls = DeploymentSpec(name="a", compute=kt.Compute().distribute("pytorch", workers=2), kind="cls")
    single_fn = DeploymentSpec(name="a", compute=kt.Compute(), kind="fn")
    assert (single_cls.concurrency, dist_cls.concurrency, single_fn.concurrency) == (8, 1, 1)
    assert DeploymentSpec(name="a", compute=kt.Compute(concurrency=3), kind="fn").concurrency == 3
    # not a pod-shaping field: changing it reloads code, it does not replace pods
    assert DeploymentSpec("a", kt.Compute(concurrency=2)).pod_hash() == DeploymentSpec("a", kt.Compute()).pod_hash()


def test_four_sync_calls_run_at_once_on_concurrency_4(napper) -> None:
    results, took = _parallel(4, lambda: napper(2.0))
    assert took < 6.0, f"4 x 2 s calls took {took:.1f}s: they ran one after another"
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
    assert took < 10.0
    assert napper(0.0)["pid"] == results[0]["pid"]  # the rank process was not killed


def test_async_method_on_a_single_rank_class_defaults_to_8_at_once() -> None:
    remote = kt.cls(Server).to(kt.Compute(), name="conc-async-cls")
    try:
        assert remote.deployment.spec.concurrency == 8
        results, took = _parallel(4, lambda: remote.slow(2.0))
        assert took < 6.0, f"4 x 2 s async calls took {took:.1f}s"
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
            time.sleep(1.0)
            killer = pool.submit(remote.die)
            errors = [f.exception(timeout=60) for f in [*running, killer]]
        assert all(isinstance(e, kt.RankDied) for e in errors), errors
        assert remote.slow(0.0) > 0  # the next call gets a fresh rank process
    finally:
        remote.teardown()


def test_async_function_on_a_distributed_deployment() -> None:
    remote = kt.fn(async_nap).to(kt.Compute().distribute("pytorch", workers=2), name="conc-async-dist")
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
        for i in range(6):
            t = threading.Thread(target=remote.record, args=(i,))
            t.start()
            threads.append(t)
            time.sleep(0.05)  # arrival order = i
        for t in threads:
            t.join(60)
        orders = remote.get_order()
        assert orders[0] == orders[1] == list(range(6)), orders
    finally:
        remote.teardown()


def test_to_takes_concurrency_too() -> None:
    remote = kt.fn(nap).to(kt.Compute(), name="conc-to-form", concurrency=3)
    try:
        assert remote.deployment.spec.concurrency == 3 and remote.compute.concurrency == 3
        results, took = _parallel(3, lambda: remote(1.5))
        assert took < 4.5 and len({r["thread"] for r in results}) == 3
    finally:
        remote.teardown()
    with pytest.raises(kt.ConfigError, match="between 1 and 1024"):
        kt.fn(nap).to(kt.Compute(), name="conc-to-bad", concurrency=0)
