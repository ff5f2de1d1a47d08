"""``ktlite put / get / ls / rm / store`` as a user runs them (real subprocesses, the local
backend's store directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(
    home: Path,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    ok: bool = True,
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    full.update(KTLITE_HOME=str(home), **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        env=full,
        cwd=cwd,
        stdin=subprocess.DEVNULL,  # no terminal, as in CI (never the one pytest may run in)
        capture_output=True,
        text=True,
        timeout=60,
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def test_put_ls_get_rm_round_trip(home: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.txt").write_text("beta")
    assert "sets/src: stored" in run(home, "put", "sets/src", str(src)).stdout
    run(home, "put", "sets/note", "--value", "hello there")
    listing = run(home, "ls", "sets").stdout.splitlines()
    assert any(line.startswith("dir") and line.endswith("src/") for line in listing)
    assert any(line.startswith("object") and line.endswith("note") for line in listing)
    deep = run(home, "ls", "sets", "-r").stdout
    assert "sets/src/sub/b.txt" in deep
    entries = json.loads(run(home, "ls", "sets", "--json").stdout)
    assert {e["key"]: e["type"] for e in entries} == {"sets/note": "object", "sets/src": "dir"}
    assert json.loads(run(home, "get", "sets/note").stdout) == "hello there"
    out = run(home, "get", "sets/src", str(tmp_path / "copy")).stdout
    assert "sets/src ->" in out and (tmp_path / "copy" / "sub" / "b.txt").read_text() == "beta"
    work = tmp_path / "work"
    work.mkdir()
    run(home, "get", "sets/src", cwd=work)  # no dest: the key's name, here
    assert (work / "src" / "a.txt").read_text() == "alpha"
    refused = run(home, "rm", "sets", ok=False)
    assert refused.returncode == 1 and "pass recursive=True (`ktlite rm -r`)" in refused.stderr
    run(home, "rm", "sets", "-r")
    assert run(home, "ls").stdout == ""


def test_errors_are_one_line_and_exit_1(home: Path, tmp_path: Path) -> None:
    missing = run(home, "get", "nope", ok=False)
    assert missing.returncode == 1
    assert (
        missing.stderr.startswith("ktlite: error: no key 'nope'")
        and "Traceback" not in missing.stderr
    )
    bad = run(home, "put", "../up", str(tmp_path), ok=False)
    assert bad.returncode == 1 and "not a valid data store key" in bad.stderr
    nothing = run(home, "put", "k", ok=False)
    assert nothing.returncode == 1 and "--value" in nothing.stderr
    typo = run(home, "put", "k", str(tmp_path / "no-such-file"), ok=False)
    assert "no such file or directory" in typo.stderr


def test_namespace_option_and_store_status(home: Path, tmp_path: Path) -> None:
    run(home, "put", "k", "--value", "A", "-n", "team-a")
    assert run(home, "ls").stdout == ""
    assert "k" in run(home, "ls", "-n", "team-a").stdout
    status = run(home, "store", "status", "-n", "team-a").stdout
    assert f"local data store: {home / 'store' / 'team-a'}" in status
    kept = run(home, "store", "teardown", "-n", "team-a", ok=False)
    assert kept.returncode == 1 and "--volumes" in kept.stdout
    run(home, "store", "teardown", "-n", "team-a", "--volumes", "-y")
    assert not (home / "store" / "team-a").exists()


def test_store_teardown_volumes_without_a_terminal_needs_yes(home: Path) -> None:
    # as `ktlite teardown --all`: stdin is no terminal (a script, CI), so nobody can answer
    # [y/N]; the data is kept and the error says what to pass
    run(home, "put", "k", "--value", "A", "-n", "team-a")
    refused = run(home, "store", "teardown", "-n", "team-a", "--volumes", ok=False)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "Traceback" not in refused.stderr and "EOFError" not in refused.stderr
    assert refused.stderr.startswith("ktlite: error: store teardown --volumes asks before it ")
    assert "no terminal to ask on: pass --yes (-y)" in refused.stderr, refused.stderr
    assert str(home / "store" / "team-a") in refused.stderr
    assert json.loads(run(home, "get", "k", "-n", "team-a").stdout) == "A"


def test_big_put_shows_progress_when_asked(home: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 << 20))
    quiet = run(home, "put", "big", str(big))
    assert quiet.stderr == ""  # not a terminal: no progress bar
    loud = run(home, "put", "big", str(big), env={"KTLITE_PROGRESS": "1"})
    assert "put big" in loud.stderr and "100.0%" in loud.stderr


def test_help_names_the_store_commands(home: Path) -> None:
    top = run(home, "--help").stdout
    for command in ("put", "get", "ls", "rm", "store"):
        assert command in top
    assert "Example: ktlite put datasets/mnist ./mnist" in " ".join(
        run(home, "put", "--help").stdout.split()
    )


def on_terminal(home: Path, typed: str, *args: str) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as its stdin/stdout (as a user at a shell), having
    typed ``typed``; its exit code and what it printed."""
    import pty
    import select
    import time

    full = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    full["KTLITE_HOME"] = str(home)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        env=full,
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    os.write(master, typed.encode())
    out, deadline = b"", time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the CLI did not exit within 60 s; it printed {out!r}") from None
    return code, out.decode(errors="replace")


def test_store_teardown_takes_yes_as_teardown_does_and_asks_on_a_terminal(home: Path) -> None:
    run(home, "put", "k", "--value", "A", "-n", "team-a")
    code, said = on_terminal(home, "n\n", "store", "teardown", "-n", "team-a", "--volumes")
    assert code == 1 and "with all its data? [y/N]" in said and "nothing torn down" in said, said
    assert (home / "store" / "team-a").exists()
    code, said = on_terminal(home, "", "store", "teardown", "-n", "team-a", "--volumes", "-y")
    assert code == 0 and "[y/N]" not in said and ": removed" in said, said
    assert not (home / "store" / "team-a").exists()
    run(home, "put", "k", "--value", "A", "-n", "team-b")
    run(home, "store", "teardown", "-n", "team-b", "--volumes", "--yes")  # no terminal: not asked
    assert not (home / "store" / "team-b").exists()
