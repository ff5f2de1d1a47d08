"""Warm result files (issue 26, item 5): a rank writes its large result into the file of an
earlier one once that was taken and nothing maps it any more, and never into one a caller or
its pod server still maps.

Real pods of the local backend: over HTTP (``KTLITE_SHM=0``: the pod server maps the file and
sends it, as on Kubernetes and SSH) and on the caller's host (the caller maps the file
itself, copy-on-write: a result it keeps is the file's pages). The rank reports its own
count of warm files (``resultfiles.process()``).
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import ktlite as kt
from ktlite_server import resultfiles, resultmaps
from ktlite_wire import shm
from ktlite_wire.keepbudget import OwnBudget

N = 3 << 18  # float32s: 3 MiB, past shm.INLINE_MAX


class Maker:
    def make(self, v: float) -> np.ndarray:
        return np.full(N, v, dtype=np.float32)

    def reused(self) -> int:
        from ktlite_server import resultfiles

        return resultfiles.process().reused

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def maker() -> Iterator[object]:
    remote = kt.cls(Maker).to(kt.Compute(stream_logs=False), name="resultfiles-maker")
    yield remote
    remote.teardown()


@pytest.fixture(params=["http", "same-host"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KTLITE_SHM", "0" if request.param == "http" else "1")
    return str(request.param)


def test_a_large_result_lands_in_the_file_the_last_one_left(maker, path) -> None:
    before = maker.reused()
    for v in (1.0, 2.0, 3.0, 4.0):
        x = maker.make(v)
        assert x.shape == (N,) and float(x.min()) == float(x.max()) == v
        del x  # nothing of this process maps its file any more
    # the first may need a fresh file (the last test's result may still be held); most must
    # not (before warm files, none did)
    assert maker.reused() - before >= 2


def test_a_result_the_caller_still_holds_is_never_written_again(maker, path) -> None:
    kept = maker.make(5.0)
    for v in (6.0, 7.0, 8.0):
        x = maker.make(v)
        assert float(x.min()) == float(x.max()) == v
        del x
    # on the caller's host ``kept`` is a copy-on-write mapping of its file: a rank writing
    # that file again would change it under the caller
    assert float(kept.min()) == float(kept.max()) == 5.0


def test_a_killed_rank_leaves_no_kept_file(maker, path) -> None:
    pid = maker.pid()
    x = maker.make(9.0)
    del x
    with pytest.raises(kt.KtliteError):
        maker.die()
    prefix = shm.TOOK_PREFIX + resultfiles.kept_prefix(pid).removeprefix(shm.RESULT_PREFIX)

    def left() -> list[str]:
        return [n for n in os.listdir(shm.shm_dir()) if n.startswith(prefix)]

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left(), f"the killed rank's result files were left: {left()}"


def _written(files: resultfiles.ResultFiles, size: int, byte: int) -> str:
    fd, path = files.create(size)
    try:
        os.pwrite(fd, bytes([byte]) * size, 0)
    finally:
        os.close(fd)
    return path


def test_a_mapped_file_is_skipped_and_a_let_go_one_reused() -> None:
    files = resultfiles.ResultFiles(OwnBudget(8 << 20))
    try:
        first = _written(files, 1 << 20, 1)
        assert shm.kept(first)
        view = shm.take(first, 1 << 20)  # as the pod server or a caller takes it
        assert not os.path.exists(first) and os.path.exists(shm.took_path(first))
        second = _written(files, 1 << 20, 2)  # the first is still mapped (here)
        assert files.reused == 0 and bytes(view[:1]) == b"\x01"
        mapping = view.obj
        view.release()
        mapping.close()  # type: ignore[union-attr]
        shm.take(second, 1 << 20).release()
        third = _written(files, (1 << 20) - 4096, 3)  # about the same size: warm
        assert files.reused == 1 and third not in (first, second)
        # the one reused was renamed to its new name; the other still waits
        assert sum(os.path.exists(shm.took_path(p)) for p in (first, second)) == 1
    finally:
        files.clear()


def test_result_files_are_bounded_and_sized() -> None:
    files = resultfiles.ResultFiles(OwnBudget(4 << 20))
    try:
        big = _written(files, 5 << 20, 1)  # over the bound: not kept, removed when taken
        assert not shm.kept(big)
        shm.take(big, 5 << 20).release()
        assert not os.path.exists(big) and not os.path.exists(shm.took_path(big))
        made = []
        for size in (1 << 20, 2 << 20, 3 << 20):  # a size the others do not fit
            made.append(_written(files, size, 2))
            shm.take(made[-1], size).release()
        took = [p for p in made if os.path.exists(shm.took_path(p))]
        held = sum(os.path.getsize(shm.took_path(p)) for p in took)
        assert held <= 4 << 20, f"kept {held} bytes over a bound of {4 << 20}"
        assert files.reused == 0
    finally:
        files.clear()
    assert not any(os.path.exists(shm.took_path(p)) for p in made)


def test_remove_left_removes_a_dead_rank_s_files() -> None:
    files = resultfiles.ResultFiles(OwnBudget(4 << 20))
    path = _written(files, 1 << 20, 1)
    shm.take(path, 1 << 20).release()
    assert os.path.exists(shm.took_path(path))
    resultfiles.remove_left(os.getpid())
    assert not os.path.exists(shm.took_path(path))


def test_the_pod_server_keeps_its_mapping_and_says_when_it_is_idle() -> None:
    files = resultfiles.ResultFiles(OwnBudget(8 << 20))
    maps = resultmaps.ResultMaps()
    try:
        first = _written(files, 1 << 20, 1)
        view = maps.take(first, 1 << 20, mmap.mmap)  # as the pod server takes it to send it
        sent = shm.renamed(first, shm.SENT_PREFIX)
        assert os.path.exists(sent) and bytes(view[:1]) == b"\x01"
        maps.release()  # a view is alive (the response still sends it): not idle
        assert os.path.exists(sent)
        second = _written(files, 1 << 20, 2)  # so the rank takes a fresh file
        assert files.reused == 0 and bytes(view[:1]) == b"\x01"
        view.release()
        maps.take(second, 1 << 20, mmap.mmap).release()
        maps.release()
        assert os.path.exists(shm.renamed(first, shm.IDLE_PREFIX))
        third = _written(files, 1 << 20, 3)  # idle: reused though the server still maps it
        assert files.reused == 1
        again = maps.take(third, 1 << 20, mmap.mmap)
        assert maps.reused == 1 and bytes(again[:1]) == b"\x03"  # its kept mapping, new bytes
        again.release()
    finally:
        files.clear()
    maps.sweep()  # the rank removed its files: the server lets go of its mappings
    assert repr(maps).startswith("ResultMaps(kept=0")


def test_a_fresh_result_file_named_like_a_kept_one_is_still_removed() -> None:
    """A result file a rank does not keep has a random name (``mkstemp``), which may start
    with the kept files' mark ("w", about one in 37): it is still not a kept file (those are
    ``ktlite-res-w<pid>-*``), so whoever takes it removes it instead of renaming it for a
    rank that will never write it again or remove it."""
    path = os.path.join(shm.shm_dir(), shm.RESULT_PREFIX + "wq7_x2ab")
    with open(path, "wb") as f:
        f.write(b"r" * 4096)
    try:
        assert not shm.kept(path)
        assert bytes(shm.take(path, 4096)[:1]) == b"r"
        assert not os.path.exists(path) and not os.path.exists(shm.took_path(path))
    finally:
        for p in (path, shm.took_path(path)):
            if os.path.exists(p):
                os.unlink(p)
    assert shm.kept(os.path.join(shm.shm_dir(), resultfiles.kept_prefix(123) + "ab12"))
