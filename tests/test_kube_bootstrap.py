"""The Kubernetes pods' bootstrap (``kube_pod_template.BOOTSTRAP``), run for real in a shell on
this machine, with the image's Python a venv that has no ktlite (``image_python``) and the boot
files of the deployment's token Secret (``kube_boot``) in a directory: the pod gets ktlite's
server from what the client shipped, and no package index is asked for anything."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import image_python
import pytest

from ktlite.backends import kube_boot, kube_deps, shipped_source
from ktlite.backends.kube_pod_template import BOOTSTRAP
from ktlite.backends.server_source import server_packages

START_S = 90.0
DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens: any index request fails at once


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image's Python with the server's packages and no ktlite."""
    return image_python.make(tmp_path_factory.mktemp("image") / "py")


@pytest.fixture(scope="module")
def bare_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image's Python with nothing installed."""
    return image_python.make(tmp_path_factory.mktemp("bare") / "py", server_packages=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pod_env(tmp_path: Path, python: Path, steps: list[list[Any]], **extra: str) -> dict[str, str]:
    """The env a pod's container gets, with the token Secret's files under ``tmp_path``."""
    boot = tmp_path / "boot"
    boot.mkdir()
    for key, value in kube_boot.secret_data(steps, "a-token").items():
        (boot / key).write_bytes(base64.b64decode(value))
    (tmp_path / "token").write_text("boot-token")
    env = {
        "PATH": f"{python}/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KTLITE_BOOT_DIR": str(boot),
        "KTLITE_STATE_DIR": str(tmp_path / "state"),
        "KTLITE_SOURCE_DIGEST": kube_boot.source_digest(),
        "KTLITE_HOST": "127.0.0.1",
        "KTLITE_PORT": str(_free_port()),
        "KTLITE_PROCS": "1",
        "KTLITE_POD_NAME": "boot-0",
        "KTLITE_TOKEN_FILE": str(tmp_path / "token"),
        "KTLITE_IMAGE": "acme/no-ktlite:1",
        "PYTHONUNBUFFERED": "1",
        # an index asked for anything fails the test's pod at once
        "PIP_INDEX_URL": DEAD_INDEX,
        "PIP_RETRIES": "0",  # pip backs off ~8 s over 5 retries of a refused index
        "OUT": str(tmp_path),
    }
    if steps:
        env["KTLITE_SETUP_FILE"] = str(boot / kube_boot.SETUP_KEY)
    env.update(extra)
    return env


@contextlib.contextmanager
def _bootstrap(env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The container's command, its output in ``cwd/pod.log``; killed with its children."""
    with open(cwd / "pod.log", "wb") as log:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", BOOTSTRAP],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _exits(env: dict[str, str], cwd: Path) -> tuple[int, str]:
    with _bootstrap(env, cwd) as proc:
        code = proc.wait(START_S)
    return code, (cwd / "pod.log").read_text()


def _serves(proc: subprocess.Popen[bytes], port: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"the bootstrap exited {proc.returncode} before serving:\n{log.read_text()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"the pod server did not answer /health on port {port} within {START_S:.0f}s")


def test_an_image_without_ktlite_runs_the_source_the_client_shipped(
    tmp_path: Path, image: Path
) -> None:
    steps = [["run_bash", 'echo ran > "$OUT/step"']]
    env = _pod_env(tmp_path, image, steps)
    probe = subprocess.run(
        [f"{image}/bin/python", "-c", "import ktlite_server"], env=env, capture_output=True
    )
    assert probe.returncode != 0, "the image's Python must not have ktlite for this test"
    with _bootstrap(env, tmp_path) as proc:
        _serves(proc, env["KTLITE_PORT"], tmp_path / "pod.log")
        # the setup step came from the Secret's file, and the server's modules from the copy
        assert (tmp_path / "step").read_text() == "ran\n"
        shipped = tmp_path / "state" / "src" / kube_boot.source_digest()
        assert (shipped / "ktlite_server" / "__pycache__").is_dir()
        assert sorted(p.name for p in shipped.iterdir()) == [
            "ktlite",
            "ktlite_server",
            "ktlite_wire",
        ]


def test_an_image_without_the_server_packages_fails_saying_what_to_add(
    tmp_path: Path, bare_image: Path
) -> None:
    code, out = _exits(_pod_env(tmp_path, bare_image, []), tmp_path)
    assert code == 78, out
    assert "acme/no-ktlite:1 lacks the pod server's packages" in out
    assert "fastapi" in out and "pip_install(" in out and "images/Dockerfile" in out


def test_freeze_runs_only_the_images_own_ktlite(tmp_path: Path, image: Path) -> None:
    code, out = _exits(_pod_env(tmp_path, image, [], KTLITE_FREEZE="1"), tmp_path)
    assert code == 78, out
    assert "this image has no ktlite" in out and "freeze=True" in out


def test_a_spoilt_copy_of_the_source_is_refused(tmp_path: Path, image: Path) -> None:
    env = _pod_env(tmp_path, image, [], KTLITE_SOURCE_DIGEST="0" * 32)
    code, out = _exits(env, tmp_path)
    assert code == 78, out
    assert "could not unpack ktlite's source" in out
    assert not (tmp_path / "state" / "src" / ("0" * 32)).exists()


def test_an_image_with_no_python_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "bin").mkdir(parents=True)
    env = _pod_env(tmp_path, empty, [])
    env["PATH"] = f"{empty}/bin"
    code, out = _exits(env, tmp_path)
    assert code == 78, out
    assert "has no python3 or python on PATH" in out


def test_the_setup_steps_travel_in_the_secret() -> None:
    steps = [["pip_install", ["--index-url", "https://me:s3cret@pypi.acme.dev/simple", "x"]]]
    data = kube_boot.secret_data(steps, "a-token")
    assert json.loads(base64.b64decode(data[kube_boot.SETUP_KEY])) == steps
    # the pod spec's digest of them says nothing of the password, and moves with the token
    digest = kube_boot.setup_digest(steps, "a-token")
    assert "s3cret" not in digest and digest != kube_boot.setup_digest(steps, "b-token")
    plan = kube_boot.secret_data(steps, None)
    assert "s3cret" not in json.dumps(plan) and "1 setup step" in plan[kube_boot.SETUP_KEY]


def _ship_packages(tmp_path: Path, env: dict[str, str]) -> None:
    """The ktlite-deps Secrets' files, as the pod's projected volume holds them."""
    parts = tmp_path / "deps"
    parts.mkdir()
    for i, part in enumerate(kube_deps._parts()):
        (parts / f"part-{i:03d}").write_bytes(part)
    (parts / "digest").write_text(shipped_source.deps_digest())
    env.update(
        KTLITE_DEPS_DIR=str(parts),
        KTLITE_DEPS_KEY=kube_deps.key(),
        KTLITE_DEPS_TAG=kube_deps.tag(),
        KTLITE_SERVER_PACKAGES=", ".join(server_packages()),
    )


def test_an_image_with_only_python_runs_the_packages_the_client_shipped(
    tmp_path: Path, bare_image: Path
) -> None:
    env = _pod_env(tmp_path, bare_image, [])
    _ship_packages(tmp_path, env)
    with _bootstrap(env, tmp_path) as proc:
        _serves(proc, env["KTLITE_PORT"], tmp_path / "pod.log")
    assert (tmp_path / "state" / "deps" / shipped_source.deps_digest() / "fastapi").is_dir()


def test_shipped_packages_built_for_another_python_are_not_used(
    tmp_path: Path, bare_image: Path
) -> None:
    env = _pod_env(tmp_path, bare_image, [])
    _ship_packages(tmp_path, env)
    env["KTLITE_DEPS_TAG"] = "cpython-399 riscv64"
    code, out = _exits(env, tmp_path)
    assert code == 78, out
    assert "built for cpython-399 riscv64; this image's Python is cpython-3" in out
    assert "lacks the pod server's packages" in out


def test_an_install_asked_for_that_fails_exits_78_at_every_start(
    tmp_path: Path, image: Path
) -> None:
    """KTLITE_INSTALL (the user's own ask for an index install) that cannot be done: the
    setup fails (78), also when the container starts again over the venv the first try
    left (it once ran that venv's Python, which has no ktlite: exit 1)."""
    env = _pod_env(tmp_path, image, [], KTLITE_INSTALL="ktlite-does-not-exist==0.1")
    for attempt in (1, 2):
        code, out = _exits(env, tmp_path)
        assert code == 78, (attempt, out)
        assert "could not install ktlite-does-not-exist==0.1" in out
    assert (tmp_path / "state" / "venv" / "bin" / "python").exists()
