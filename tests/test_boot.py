"""``ktlite_server.boot``, the Kubernetes pod entry point, run for real on this machine.

Setup steps run in real shells, pip installs a real (hand-built, offline) wheel into a
real venv under ``KTLITE_STATE_DIR``, and the end-to-end tests exec a real server and
ask it for ``/health``. Nothing is mocked; nothing needs the network.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ktlite_server.boot import SETUP_FAILED_EXIT, run_steps

TINY = "ktlite_tiny_probe"
TINY_VERSION = "0.1"
RUN_STEPS = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from ktlite_server.boot import run_steps\n"
    "python = run_steps(json.loads(sys.argv[1]), Path(sys.argv[2]))\n"
    "print('PYTHON=' + python)\n"
)
SERVER_START_S = 60.0


def _digest(steps: list[list[Any]]) -> str:
    return hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()[:16]


def _build_wheel(where: Path) -> Path:
    """A minimal pure-Python wheel, written by hand: pip installs it with --no-index."""
    dist_info = f"{TINY}-{TINY_VERSION}.dist-info"
    files = {
        f"{TINY}.py": "VALUE = 'tiny-ok'\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {TINY}\nVersion: {TINY_VERSION}\n",
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: ktlite-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    wheel = where / f"{TINY}-{TINY_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KTLITE_FREEZE", "KTLITE_SETUP", "KTLITE_STATE_DIR", "KTLITE_TOKEN")
    }
    env.update(PYTHONUNBUFFERED="1", PIP_NO_INPUT="1", **extra)
    return env


def _boot_steps(
    steps: list[list[Any]], state: Path, out: Path
) -> tuple[int, str, str | None, float]:
    """run_steps in a fresh interpreter: (exit code, output, returned python, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", RUN_STEPS, json.dumps(steps), str(state)],
        env=_env(OUT=str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    seconds = time.monotonic() - start
    python = None
    for line in proc.stdout.splitlines():
        if line.startswith("PYTHON="):
            python = line.removeprefix("PYTHON=")
    return proc.returncode, proc.stdout, python, seconds


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _boot_server(tmp_path: Path, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], Path, int]]:
    """``python -m ktlite_server.boot`` in its own process group; always stopped on exit."""
    port = _free_port()
    log = tmp_path / "boot.log"
    full = _env(
        KTLITE_TOKEN="boot-test-token",
        KTLITE_PORT=str(port),
        KTLITE_PROCS="1",
        KTLITE_POD_NAME="boot-test-0",
        **env,
    )
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ktlite_server.boot"],
            env=full,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, log, port
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # the group this test created: the server and any rank process it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait_health(proc: subprocess.Popen[bytes], log: Path, port: int) -> dict[str, Any]:
    deadline = time.monotonic() + SERVER_START_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"boot exited with {proc.returncode} before serving:\n{log.read_text()}")
        try:
            resp = httpx.get(
                f"http://127.0.0.1:{port}/health",
                timeout=2.0,
                headers={"x-ktlite-token": "Bearer boot-test-token"},
            )
        except httpx.HTTPError as e:
            last = repr(e)
        else:
            if resp.status_code == 200:
                body: dict[str, Any] = resp.json()
                return body
            last = f"HTTP {resp.status_code}"
        time.sleep(0.1)
    pytest.fail(f"no /health answer within {SERVER_START_S:g}s ({last}):\n{log.read_text()}")


# ---- run_steps in this process ------------------------------------------------------------------


def test_bash_steps_run_with_this_python_and_leave_a_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    state = tmp_path / "state"
    state.mkdir()
    steps: list[list[Any]] = [
        ["run_bash", "echo hello > $OUT/marker"],
        ["run_bash", 'echo "bash=$BASH_VERSION" >> $OUT/marker; echo visible'],
    ]
    assert run_steps(steps, state) == sys.executable
    lines = (tmp_path / "marker").read_text().splitlines()
    assert lines[0] == "hello"
    assert lines[1].startswith("bash=") and lines[1] != "bash="  # bash, not sh
    marker = state / f"setup-{_digest(steps)}.done"
    assert marker.exists()
    assert json.loads(marker.read_text()) == steps
    assert not (state / "venv").exists()  # no pip step: no venv
    out = capsys.readouterr().out
    assert "step 1: echo hello > $OUT/marker" in out
    assert "  visible" in out


def test_bash_steps_rerun_even_when_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a container restart threw away what bash changed: bash steps always run again
    monkeypatch.setenv("OUT", str(tmp_path))
    steps: list[list[Any]] = [["run_bash", "echo again >> $OUT/log"]]
    run_steps(steps, tmp_path)
    run_steps(steps, tmp_path)
    assert (tmp_path / "log").read_text().splitlines() == ["again", "again"]
    assert "cached" not in capsys.readouterr().out


# ---- failing steps: a real process that exits 78 ------------------------------------------------


def test_failing_step_exits_78_with_its_output(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    steps: list[list[Any]] = [
        ["run_bash", "echo before"],
        ["run_bash", "echo boom; exit 3"],
        ["run_bash", "echo after > $OUT/after"],
    ]
    rc, out, python, _ = _boot_steps(steps, state, tmp_path)
    assert rc == SETUP_FAILED_EXIT == 78
    assert "boom" in out
    assert "step failed" in out and "exit code 3" in out
    assert python is None
    assert not (tmp_path / "after").exists()  # later steps do not run
    assert not list(state.glob("setup-*.done"))  # nothing recorded as done


def test_failing_step_through_boot_main_exits_78(tmp_path: Path) -> None:
    env = _env(
        KTLITE_SETUP=json.dumps([["run_bash", "echo boom; exit 3"]]),
        KTLITE_STATE_DIR=str(tmp_path / "state"),
        KTLITE_TOKEN="t",
        KTLITE_PORT="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite_server.boot"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=60,
    )
    assert proc.returncode == 78, proc.stdout
    assert "boom" in proc.stdout and "step failed" in proc.stdout


def test_unknown_step_kind_exits_78(tmp_path: Path) -> None:
    rc, out, _, _ = _boot_steps([["conda_install", ["numpy"]]], tmp_path, tmp_path)
    assert rc == 78
    assert "unknown step 'conda_install'" in out


# ---- pip steps: one real venv per module (per xdist worker) -------------------------------------


@pytest.fixture(scope="module")
def pip_boot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pip-boot")
    wheel = _build_wheel(root)
    state = root / "state"
    state.mkdir()
    steps: list[list[Any]] = [
        ["run_bash", "echo first >> $OUT/bash.log"],
        ["pip_install", ["--no-index", str(wheel)]],
    ]
    rc, out, python, seconds = _boot_steps(steps, state, root)
    assert rc == 0, out
    return {
        "root": root,
        "wheel": wheel,
        "state": state,
        "steps": steps,
        "out": out,
        "python": python,
        "seconds": seconds,
    }


def test_pip_step_installs_into_a_venv_under_the_state_dir(pip_boot: dict[str, Any]) -> None:
    state: Path = pip_boot["state"]
    assert pip_boot["python"] == str(state / "venv" / "bin" / "python")
    assert Path(pip_boot["python"]).exists()
    assert (state / f"setup-{_digest(pip_boot['steps'])}.done").exists()
    out = pip_boot["out"]
    assert "creating" in out and "step 2: pip install --no-index" in out
    assert "cached" not in out
    assert (pip_boot["root"] / "bash.log").read_text().splitlines() == ["first"]
    # installed into the venv, not into the interpreter running the tests
    assert importlib.util.find_spec(TINY) is None


def test_venv_imports_the_package_and_the_parent_interpreters_packages(
    pip_boot: dict[str, Any],
) -> None:
    code = (
        f"import {TINY}, httpx, cloudpickle, sys; "
        f"print({TINY}.VALUE, {TINY}.__file__.startswith(sys.prefix), sys.prefix)"
    )
    proc = subprocess.run(
        [pip_boot["python"], "-c", code], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert proc.returncode == 0, proc.stderr
    value, inside, prefix = proc.stdout.split()
    assert value == "tiny-ok"
    assert inside == "True"
    assert Path(prefix) == pip_boot["state"] / "venv"


def test_same_steps_skip_pip_but_rerun_bash(pip_boot: dict[str, Any], tmp_path: Path) -> None:
    rc, out, python, seconds = _boot_steps(pip_boot["steps"], pip_boot["state"], tmp_path)
    assert rc == 0, out
    assert python == pip_boot["python"]
    assert (
        f"pip install --no-index {pip_boot['wheel']} (cached, {_digest(pip_boot['steps'])})" in out
    )
    assert "creating" not in out
    assert (tmp_path / "bash.log").read_text().splitlines() == ["first"]  # bash ran again
    assert seconds < pip_boot["seconds"] / 2, (seconds, pip_boot["seconds"])


def test_changed_steps_run_again(pip_boot: dict[str, Any], tmp_path: Path) -> None:
    steps = [*pip_boot["steps"], ["run_bash", "echo second >> $OUT/bash.log"]]
    rc, out, python, _ = _boot_steps(steps, pip_boot["state"], tmp_path)
    assert rc == 0, out
    assert python == pip_boot["python"]
    assert "cached" not in out
    assert "step 2: pip install --no-index" in out
    assert (tmp_path / "bash.log").read_text().splitlines() == ["first", "second"]
    state: Path = pip_boot["state"]
    assert (state / f"setup-{_digest(steps)}.done").exists()
    assert (state / f"setup-{_digest(pip_boot['steps'])}.done").exists()


# ---- boot main(): steps, then exec the server ---------------------------------------------------


def test_boot_runs_steps_then_serves_health(tmp_path: Path) -> None:
    state = tmp_path / "state"
    setup = json.dumps([["run_bash", "echo ready-step"], ["run_bash", "echo done > $OUT/ran"]])
    with _boot_server(
        tmp_path, KTLITE_SETUP=setup, KTLITE_STATE_DIR=str(state), OUT=str(tmp_path)
    ) as (proc, log, port):
        health = _wait_health(proc, log, port)
        assert health["status"] == "ok"
        assert health["pod"] == "boot-test-0"
        text = log.read_text()
        assert "ready-step" in text
        assert text.index("ready-step") < text.index("ktlite setup: done")
        assert (tmp_path / "ran").read_text() == "done\n"
        assert len(list(state.glob("setup-*.done"))) == 1
        # boot exec'd the server: the process it started is now the server itself
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        if cmdline.exists():
            argv = cmdline.read_bytes().split(b"\0")
            assert b"ktlite_server" in argv and b"ktlite_server.boot" not in argv
            assert argv[argv.index(b"--port") + 1] == str(port).encode()
        # and it holds the token it was given: a wrong one is refused
        resp = httpx.get(
            f"http://127.0.0.1:{port}/status",
            timeout=5.0,
            headers={"x-ktlite-token": "Bearer wrong"},
        )
        assert resp.status_code in (401, 403)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0  # SIGTERM is a clean shutdown


def test_boot_freeze_skips_the_steps(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # were the steps run, the failing one would stop the boot with exit code 78
    setup = json.dumps([["run_bash", "echo ran > $OUT/ran; exit 1"]])
    with _boot_server(
        tmp_path,
        KTLITE_SETUP=setup,
        KTLITE_FREEZE="1",
        KTLITE_STATE_DIR=str(state),
        OUT=str(tmp_path),
    ) as (proc, log, port):
        assert _wait_health(proc, log, port)["status"] == "ok"
        assert not (tmp_path / "ran").exists()
        assert not state.exists()
        assert "ktlite setup" not in log.read_text()


def test_server_starts_under_the_pip_venv(pip_boot: dict[str, Any], tmp_path: Path) -> None:
    # same steps as the fixture: the pip step is cached, then the venv python runs the server
    with _boot_server(
        tmp_path,
        KTLITE_SETUP=json.dumps(pip_boot["steps"]),
        KTLITE_STATE_DIR=str(pip_boot["state"]),
        OUT=str(tmp_path),
    ) as (proc, log, port):
        assert _wait_health(proc, log, port)["status"] == "ok"
