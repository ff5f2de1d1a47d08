"""Local hygiene (issue 25, item 8): what ktlite writes on a machine is its user's alone.

Directories 0700, files 0600, temporary files under unpredictable names that never follow a
planted link. One real local deployment (``lf-target``, 2 pods) is looked at from outside.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import uuid
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.modes.outcomes import split
from ktlite_wire import codec, privatefiles, shm
from ktlite_wire.errors import ProtocolError
from ktlite_wire.outcome import CallResult, RankOutcome, ShmRef
from ktlite_wire.status import Status

NAME = "lf-target"


def target(mode: str) -> object:
    if mode == "ips-file":
        path = os.environ["KTLITE_POD_IPS_FILE"]
        with open(path) as f:
            return {
                "path": path,
                "dir_mode": os.stat(os.path.dirname(path)).st_mode & 0o777,
                "ips": json.load(f)["pod_ips"],
            }
    raise AssertionError(mode)


def target_again(mode: str) -> object:
    return target(mode)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(target, name=NAME).to(kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1))
    yield r
    r.teardown()


def _state() -> dict:
    return json.loads((Path(os.environ["KTLITE_HOME"]) / "local" / NAME / "state.json").read_text())


# ---- temporary files on a pod ------------------------------------------------------------------


def test_pod_ips_file_is_in_a_private_directory(remote) -> None:
    for got in remote("ips-file", stream_logs=False):
        assert got["dir_mode"] == 0o700
        assert got["ips"] == ["127.0.0.1", "127.0.0.1"]
        assert os.path.dirname(got["path"]) != tempfile.gettempdir()


def test_a_link_planted_at_the_old_predictable_name_is_not_followed(remote, tmp_path) -> None:
    # before: each deploy wrote /tmp/ktlite-pod-ips-<pid>.json.tmp with open(..., "w"),
    # through whatever link another user had put there
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = []
    for pod in _state()["pods"]:
        link = Path(tempfile.gettempdir()) / f"ktlite-pod-ips-{pod['pid']}.json.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
        planted.append(link)
    try:
        again = kt.fn(target_again, name=NAME).to(
            kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1)
        )
        assert [g["ips"] for g in again("ips-file", stream_logs=False)] == [["127.0.0.1"] * 2] * 2
        assert victim.read_text() == "untouched"
        assert all(link.is_symlink() for link in planted)
    finally:
        for link in planted:
            link.unlink(missing_ok=True)


# ---- shared memory: only ktlite's own files, on a pod's say-so ---------------------------------


def _reply_naming(*paths: tuple[str, int]) -> list:
    """A pod's call result as the caller receives it (encoded, then decoded), each rank's value
    handed over in the shared-memory file it names."""
    result = CallResult(
        [RankOutcome(r, "pod-0", Status.OK, ShmRef(p, n)) for r, (p, n) in enumerate(paths)]
    )
    return CallResult.decode(bytearray(result.encode_bytes())).outcomes


def _own_shm_file(value: object) -> tuple[str, int]:
    return shm.write([codec.dumps(value)], shm.RESULT_PREFIX)


@pytest.mark.parametrize("where", ["outside", "dotdot", "wrong-prefix", "link", "fifo"])
def test_client_refuses_a_shared_memory_path_that_is_not_ktlites(tmp_path, where) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(codec.dumps("the victim's content")))
    size = victim.stat().st_size
    link = Path(shm.shm_dir()) / f"{shm.RESULT_PREFIX}{uuid.uuid4().hex}"
    path = {
        "outside": str(victim),
        "dotdot": f"{shm.shm_dir()}/../..{victim}",  # /dev/shm/../.. is /
        "wrong-prefix": str(Path(shm.shm_dir()) / f"not-ktlite-{uuid.uuid4().hex}"),
        "link": str(link),
        "fifo": str(link),  # a fifo under ktlite's name: opening it to read used to block
    }[where]
    if where == "wrong-prefix":
        Path(path).write_bytes(victim.read_bytes())
    if where == "link":
        link.symlink_to(victim)
    if where == "fifo":
        os.mkfifo(link, 0o600)
    own, own_size = _own_shm_file("rank 1's value")
    try:
        with pytest.raises(ProtocolError) as info:
            split(_reply_naming((path, size), (own, own_size)))
        assert path in str(info.value)
        # the named file is neither removed nor read; the genuine one is still taken
        assert victim.read_bytes() == bytes(codec.dumps("the victim's content"))
        assert os.path.lexists(path)
        assert not os.path.exists(own)
    finally:
        for p in (path, own):
            if where in ("wrong-prefix", "link", "fifo") or p == own:
                Path(p).unlink(missing_ok=True)


def test_client_takes_its_own_shared_memory_files() -> None:
    own, size = _own_shm_file(list(range(10)))
    failures, values = split(_reply_naming((own, size)))
    assert not failures and values == {0: list(range(10))}
    assert not os.path.exists(own)


# ---- modes: KTLITE_HOME and everything ktlite writes under it ----------------------------------


def _loose(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Everything under ``root`` (and root) that group or others can use, with its mode."""
    found = []
    for here, dirs, files in os.walk(root):
        for p in [Path(here)] + [Path(here) / n for n in (*dirs, *files)]:
            rel = p.relative_to(root)
            if rel.parts and rel.parts[0] in skip:
                continue
            if not p.is_symlink() and _mode(p) & 0o077:
                found.append(f"{rel} {oct(_mode(p))}")
    return found


def helper_rank() -> int:
    return int(os.environ["RANK"])


def test_home_and_what_a_deployment_writes_are_private(monkeypatch, tmp_path, caplog) -> None:
    # a home an older ktlite left open: 0755 with a 0644 config and a deployment directory
    home = tmp_path / "home"
    (home / "local" / "old").mkdir(parents=True)
    (home / "config.json").write_text("{}")
    (home / "local" / "old" / "pod-0.log").write_text("old output")
    for p in (home, home / "local", home / "local" / "old"):
        p.chmod(0o755)
    for p in (home / "config.json", home / "local" / "old" / "pod-0.log"):
        p.chmod(0o644)
    monkeypatch.setenv("KTLITE_HOME", str(home))
    old_umask = os.umask(0o022)  # the usual one, under which files came out 0644
    try:
        with caplog.at_level("WARNING", logger="ktlite.config"):
            r = kt.fn(helper_rank, name="lf-modes").to(
                kt.Compute(cpus=1).distribute("spmd", workers=2, num_proc=1)
            )
        try:
            assert r(stream_logs=False) == [0, 1]
            kt.config.set("backend", "local")
            kt.put("lf-modes/value", {"a": 1}, backend="local")
            files = {str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()}
            assert {"config.json", "local/lf-modes/state.json", "local/lf-modes/pod-0.log"} <= files
            assert any(f.startswith("store/") for f in files), files
            assert _loose(home) == []
        finally:
            r.teardown()
    finally:
        os.umask(old_umask)
    assert any("made it private" in rec.getMessage() for rec in caplog.records)


# ---- the helper every writer goes through ------------------------------------------------------


def test_private_files_never_write_through_a_link(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    d = tmp_path / "d"
    privatefiles.make_dir(d / "a" / "b")
    assert [_mode(p) for p in (d, d / "a", d / "a" / "b")] == [0o700] * 3
    (d / "state.json").symlink_to(victim)
    privatefiles.write_file(d / "state.json", "new")  # replaces the link, never follows it
    assert victim.read_text() == "untouched" and not (d / "state.json").is_symlink()
    assert _mode(d / "state.json") == 0o600 and (d / "state.json").read_text() == "new"
    (d / "pod.log").symlink_to(victim)
    with pytest.raises(OSError):
        privatefiles.open_append(d / "pod.log")
    assert victim.read_text() == "untouched"
    assert sorted(os.listdir(d)) == ["a", "pod.log", "state.json"]  # no temporary file left
