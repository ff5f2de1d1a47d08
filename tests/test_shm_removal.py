"""Shared-memory files are removed on a thread of their own (``shm.remove_later``), so the
milliseconds that freeing a large file's pages takes delay neither a call's return nor a pod
server's event loop (issue 26, item 4); a process that exits first still removes them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ktlite_wire import shm


def _gone(path: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_queued_file_is_removed() -> None:
    path, size = shm.write([b"x" * (2 << 20)], shm.ARG_PREFIX)
    assert size == 2 << 20
    shm.remove_later(path)
    assert _gone(path), f"{path} still there 10 s after remove_later"


def test_a_missing_file_does_not_stop_the_remover() -> None:
    path, _ = shm.write([b"y"], shm.ARG_PREFIX)
    os.unlink(path)
    shm.remove_later(path)  # already gone: ignored
    later, _ = shm.write([b"z"], shm.ARG_PREFIX)
    shm.remove_later(later)
    assert _gone(later)


def test_files_queued_by_an_exiting_process_are_removed() -> None:
    code = (
        "from ktlite_wire import shm\n"
        "paths = [shm.write([b'a' * (4 << 20)], shm.ARG_PREFIX)[0] for _ in range(20)]\n"
        "for p in paths: shm.remove_later(p)\n"
        "print('\\n'.join(paths))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert len(out) == 20
    left = [p for p in out if os.path.exists(p)]
    for p in left:  # do not leave them to the next run either
        os.unlink(p)
    assert not left, f"{len(left)} of 20 files outlived the process that queued them"
