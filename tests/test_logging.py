"""Diagnostics through ``logging``: the ``ktlite`` and ``ktlite_server`` loggers,
``KTLITE_LOG_LEVEL`` on the client and in the pods, the stderr handler that yields to the
application's own logging, and no token in any record.

Real parts throughout: fresh interpreters, a real pod server, a real local deployment (its
pod log read as ``ktlite logs`` reads it) and the real ``ktlite`` command.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
import ktlite.backends.kube_manifests as km
import ktlite.backends.kube_store as ks
from ktlite import logconfig
from ktlite.backends.local import LocalBackend
from ktlite.commands import supervisor
from ktlite.specs.deployment_spec import DeploymentSpec

LOG_ENV = "KTLITE_LOG_LEVEL"


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != LOG_ENV}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- the client's handler and level -----------------------------------------------------------

LIBRARY_USE = """
    import logging
    import ktlite
    {setup}
    logging.getLogger("ktlite.backends.local").warning("w-%s", 1)
    logging.getLogger("ktlite.modes.deploy").info("i-%s", 2)
    logging.getLogger("ktlite.net.client").debug("d-%s", 3)
"""


def test_warnings_show_on_stderr_once_and_the_level_comes_from_the_environment() -> None:
    plain = _python(LIBRARY_USE.format(setup=""))
    assert (plain.returncode, plain.stdout) == (0, ""), plain.stderr
    assert plain.stderr == "WARNING ktlite.backends.local: w-1\n"

    info = _python(LIBRARY_USE.format(setup=""), env={LOG_ENV: "info"})
    assert info.stderr == "WARNING ktlite.backends.local: w-1\nINFO ktlite.modes.deploy: i-2\n", (
        info.stderr
    )
    debug = _python(LIBRARY_USE.format(setup=""), env={LOG_ENV: "DEBUG"})
    assert debug.stderr.splitlines()[-1] == "DEBUG ktlite.net.client: d-3", debug.stderr

    bad = _python(LIBRARY_USE.format(setup=""), env={LOG_ENV: "loud"})
    assert bad.returncode == 0 and "w-1" in bad.stderr and "i-2" not in bad.stderr, bad.stderr
    assert bad.stderr.count("KTLITE_LOG_LEVEL='loud' is not a log level") == 1, bad.stderr


def test_an_application_that_configures_logging_gets_the_records_once() -> None:
    setup = 'logging.basicConfig(format="APP %(levelname)s %(name)s %(message)s")'
    app = _python(LIBRARY_USE.format(setup=setup))
    assert app.stderr == "APP WARNING ktlite.backends.local w-1\n", app.stderr
    # the application's level for ktlite is its own; KTLITE_LOG_LEVEL still lowers it
    app_info = _python(LIBRARY_USE.format(setup=setup), env={LOG_ENV: "INFO"})
    assert app_info.stderr.splitlines() == [
        "APP WARNING ktlite.backends.local w-1",
        "APP INFO ktlite.modes.deploy i-2",
    ], app_info.stderr


def test_a_diagnostic_that_printed_is_a_log_record_at_its_level(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.WARNING, logger="ktlite")
    assert supervisor.supervise("logging-no-such-deployment") == 1
    records = [r for r in caplog.records if r.name == "ktlite.commands.supervisor"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.ERROR, "no autoscaled local deployment 'logging-no-such-deployment'")
    ]
    assert capsys.readouterr().err == ""  # the application (pytest) logs: no second copy


def test_the_pod_server_logs_through_ktlite_server_at_its_level(tmp_path: Path) -> None:
    """A real pod server that stops itself (inactivity_ttl): the notice is a WARNING record
    of ``ktlite_server`` on its stderr (the pod log), in the pod's format."""
    env = {k: v for k, v in os.environ.items() if k != LOG_ENV}
    env["KTLITE_TOKEN"] = "tok-" + "s3cret" * 4
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--inactivity-ttl",
            "0.3",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    stopping = [line for line in done.stderr.splitlines() if "inactivity_ttl" in line]
    assert len(stopping) == 1, done.stderr
    assert " WARNING ktlite_server.inactivity[" in stopping[0], stopping
    assert stopping[0].endswith("]: no client for 0.3s (inactivity_ttl): stopping"), stopping
    assert "s3cret" not in done.stderr


# ---- KTLITE_LOG_LEVEL reaches the pods --------------------------------------------------------


def test_pod_env_and_manifests_carry_the_level_only_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def env(objs: list[dict[str, Any]]) -> dict[str, str]:
        sts = next(o for o in objs if o["kind"] == "StatefulSet")
        return {
            e["name"]: e.get("value")
            for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        }

    def rendered_env() -> dict[str, str]:  # a deployment's pods
        return env(
            km.render(
                DeploymentSpec(name="logging-k", pod=kt.Compute(backend="kubernetes").pod_spec()),
                "default",
                image="python:3.12-slim",
                install="ktlite==0",
                token="t",
            )
        )

    def store_env() -> dict[str, str]:  # the namespace's data store pod
        return env(ks.render("default", image="python:3.12-slim", install="ktlite==0", token=None))

    monkeypatch.delenv(LOG_ENV, raising=False)
    assert logconfig.pod_env() == {}
    assert LOG_ENV not in rendered_env() and LOG_ENV not in store_env()
    monkeypatch.setenv(LOG_ENV, "DEBUG")
    assert logconfig.pod_env() == {LOG_ENV: "DEBUG"}
    assert rendered_env()[LOG_ENV] == "DEBUG" and store_env()[LOG_ENV] == "DEBUG"
    monkeypatch.setenv(LOG_ENV, "loud")  # not a level: the pods keep their default
    assert logconfig.pod_env() == {}


def double(x: int) -> int:
    print(f"user output {x}", flush=True)
    return 2 * x


@pytest.fixture
def debug_deployment(monkeypatch: pytest.MonkeyPatch) -> Iterator[kt.RemoteFunction]:
    monkeypatch.setenv(LOG_ENV, "DEBUG")
    remote = kt.fn(double).to(kt.Compute(stream_logs=True), name="logging-debug")
    try:
        yield remote
    finally:
        remote.teardown()


@pytest.mark.timeout(180)
def test_debug_level_logs_requests_on_both_sides_and_never_the_token(
    debug_deployment: kt.RemoteFunction,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG, logger="ktlite")
    remote = debug_deployment
    assert remote(21) == 42
    token = remote.deployment.applied.token
    assert len(token) >= 20

    # the caller: each request to the pod is a DEBUG record of ktlite.net.client
    client = [r.getMessage() for r in caplog.records if r.name == "ktlite.net.client"]
    assert any(m.startswith("POST http://") and "/call -> 200" in m for m in client), client
    # the user's rank output stays a stream, not a record
    assert not any("user output" in r.getMessage() for r in caplog.records)
    assert "user output 21" in capfd.readouterr().out

    # the same from the command line, which installs its stderr handler
    env = {**os.environ, LOG_ENV: "DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", "status", "logging-debug"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "DEBUG ktlite.net.client: GET http://127.0.0.1:" in done.stderr, done.stderr

    # the pod: its server logs at DEBUG (handed over by the client), to the pod log; read
    # after the status request, which the server answered after it logged the call
    pod_log = "\n".join(LocalBackend.shared().logs("logging-debug", 0))
    requests = [line for line in pod_log.splitlines() if "DEBUG ktlite_server.requests" in line]
    assert any("POST /deploy from " in line and " -> 200 in " in line for line in requests), pod_log
    assert any("POST /call from " in line and " -> 200 in " in line for line in requests), pod_log

    for text in (caplog.text, pod_log, done.stdout, done.stderr):
        assert token not in text
    assert "Bearer" not in caplog.text and "Bearer" not in pod_log


# ---- the Kubernetes API client: its requests at DEBUG, never its credentials ---------------


class _ApiServer(BaseHTTPRequestHandler):
    """A stand-in API server that lists no pods and remembers the Authorization it got."""

    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append(self.headers.get("Authorization", ""))
        body = json.dumps({"kind": "PodList", "items": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_kubernetes_api_requests_are_debug_records_without_the_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ktlite.backends import kube_api

    secret = "kube-" + "t0ken" * 6
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "stand-in",
                    "clusters": [
                        {
                            "name": "stand-in",
                            "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                        }
                    ],
                    "users": [{"name": "me", "user": {"token": secret}}],
                    "contexts": [
                        {"name": "stand-in", "context": {"cluster": "stand-in", "user": "me"}}
                    ],
                }
            )
        )
        caplog.set_level(logging.DEBUG, logger="ktlite")
        http, info = kube_api.load(str(kubeconfig))
        with http:
            pods = kube_api.KubeApi(http, "team").list("Pod")
    finally:
        server.shutdown()
        server.server_close()
    assert pods == []
    assert _ApiServer.seen == [f"Bearer {secret}"]  # the token did travel, in its header
    records = [r.getMessage() for r in caplog.records if r.name == "ktlite.backends.kube_api"]
    assert records == [
        f"GET http://127.0.0.1:{server.server_port}/api/v1/namespaces/team/pods -> 200"
    ], records
    assert secret not in caplog.text and "Bearer" not in caplog.text


# ---- the data store's server and client --------------------------------------------------------


def test_the_store_server_and_client_log_requests_at_debug_without_the_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ktlite.datastore.store_client import StoreClient

    token = "store-" + "s3cret" * 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready.json"
    env = {**os.environ, "KTLITE_STORE_ROOT": str(tmp_path / "pvc"), "KTLITE_TOKEN": token}
    env[LOG_ENV] = "DEBUG"
    argv = [sys.executable, "-m", "ktlite_server", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--ready-file", str(ready)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the store server did not start"
            )
            time.sleep(0.05)
        caplog.set_level(logging.DEBUG, logger="ktlite")
        client = StoreClient(f"http://127.0.0.1:{port}", token)
        try:
            assert client.ls("", recursive=True) == []
        finally:
            client.close()
    finally:
        proc.terminate()
        _, server_log = proc.communicate(timeout=30)
    records = [r.getMessage() for r in caplog.records if r.name == "ktlite.datastore.store_client"]
    assert records == [f"GET http://127.0.0.1:{port}/store/v1/ls -> 200"], records
    served = [line for line in server_log.splitlines() if "DEBUG ktlite_server.requests" in line]
    assert len(served) == 1 and "GET /store/v1/ls from 127.0.0.1 -> 200 in " in served[0], (
        server_log
    )
    for text in (caplog.text, server_log):
        assert token not in text and "s3cret" not in text
