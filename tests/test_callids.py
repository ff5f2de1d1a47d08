"""``ktlite.modes.callids``: every call's id is unique, across threads and across a fork (a
pod runs a call id at most once, so two calls with one id would share one run)."""

from __future__ import annotations

import concurrent.futures
import os

from ktlite.modes import callids


def test_ids_are_32_hex_digits_and_unique_across_threads() -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batches = list(pool.map(lambda _: [callids.new() for _ in range(5000)], range(8)))
    ids = [i for batch in batches for i in batch]
    assert len(set(ids)) == len(ids) == 40000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_forked_child_makes_ids_of_its_own() -> None:
    callids.new()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(callids.new() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    mine = [callids.new() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(mine)
    assert {i[:16] for i in child}.isdisjoint({i[:16] for i in mine})  # another random half
