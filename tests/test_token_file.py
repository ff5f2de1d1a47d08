"""The pod server reads the deployment token from a file (a Secret volume on Kubernetes), so
it is in no process's environment: a real ``python -m ktlite_server`` and a real rank."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_procs import stop

import ktlite as kt

WAIT = 60.0


def _server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_TOKEN")}
    return {**env, **extra}


def _start(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """The server, its output to ``tmp_path/server.log``, and the path of its ready file."""
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "ktlite_server", "--host", "127.0.0.1", "--port", "0"]
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--procs", "1", "--ready-file", str(ready)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    return proc, ready


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[tuple[str, str, int]]:
    """(url, token, pid) of a pod server given its token as a 0400 file only."""
    token = secrets.token_urlsafe(24)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o400)
    proc, ready = _start(tmp_path, _server_env(KTLITE_TOKEN_FILE=str(path)))
    try:
        deadline = time.monotonic() + WAIT
        while not ready.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the server exited: {(tmp_path / 'server.log').read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the server wrote no ready file in {WAIT:g}s")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        yield f"http://127.0.0.1:{port}", token, proc.pid
    finally:
        stop(proc)


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_the_server_takes_its_token_from_the_file_and_no_process_has_it_in_its_env(
    file_server: tuple[str, str, int],
) -> None:
    url, token, pid = file_server
    assert httpx.get(f"{url}/status", timeout=WAIT).status_code == 401
    with httpx.Client(headers={"x-ktlite-token": f"Bearer {token}"}, timeout=WAIT) as http:
        status = http.get(f"{url}/status")
        assert status.status_code == 200, status.text
        ranks = [r["pid"] for r in status.json()["ranks"] if r.get("pid")]
    assert ranks, status.json()
    for each in (pid, *ranks):
        environ = _environ(each)
        assert token.encode() not in environ, f"/proc/{each}/environ holds the token"
        assert b"KTLITE_TOKEN=" not in environ


@pytest.mark.parametrize(
    ("content", "expect"),
    [(None, "cannot read the deployment token from"), ("", "is empty")],
    ids=["missing", "empty"],
)
def test_a_token_file_it_cannot_use_stops_the_server_naming_the_file(
    tmp_path: Path, content: str | None, expect: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    proc, _ = _start(tmp_path, _server_env(KTLITE_TOKEN_FILE=str(path)))
    assert proc.wait(WAIT) != 0
    err = (tmp_path / "server.log").read_text()
    assert expect in err and str(path) in err, err


def test_the_local_backend_still_hands_the_token_over_stdin(tmp_path: Path) -> None:
    def env_names() -> list[str]:
        return sorted(os.environ)

    remote = kt.fn(env_names).to(kt.Compute(backend="local"), name="token-stdin")
    try:
        assert "KTLITE_TOKEN" not in remote()
        assert "KTLITE_TOKEN_FILE" not in remote()
    finally:
        remote.teardown()


def test_a_server_told_to_read_stdin_ignores_a_token_file_it_inherited(tmp_path: Path) -> None:
    """A rank on a Kubernetes pod that starts a local deployment of its own: that server gets
    its token on stdin, and must not take the pod's token file from the inherited env."""
    pod_token, own = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    (tmp_path / "pod-token").write_text(pod_token)
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "ktlite_server", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--procs", "0", "--token-stdin", "--ready-file", str(ready)],
        env=_server_env(KTLITE_TOKEN_FILE=str(tmp_path / "pod-token")),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write(own.encode() + b"\n")
        proc.stdin.flush()
        deadline = time.monotonic() + WAIT
        while not ready.exists():
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"no ready file in {WAIT:g}s"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/status"
        for token, code in ((own, 200), (pod_token, 401)):
            answer = httpx.get(url, headers={"x-ktlite-token": f"Bearer {token}"}, timeout=WAIT)
            assert answer.status_code == code, (token == own, answer.text)
    finally:
        proc.terminate()
        proc.wait(15)
        assert proc.stdin is not None
        proc.stdin.close()
