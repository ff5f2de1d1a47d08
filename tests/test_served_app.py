"""kt.app(port=..., health_check=...): a command that serves HTTP on its pods, reached here
through its pod server (``/ports/P/...``) at a local URL, and ``ktlite port-forward``."""

from __future__ import annotations

import argparse
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import ktlite as kt
from ktlite.commands import portforward_cli
from ktlite.errors import ConfigError, ReplicaFailed
from ktlite_wire.headers import TOKEN_HEADER, bearer

APPS = Path(__file__).parent / "apps_served"
EXAMPLES = Path(__file__).parent.parent / "examples"
NAME = "served-echo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served():
    port = _free_port()
    app = kt.app(
        cli_command=[sys.executable, "echo_app.py", str(port)],
        port=port,
        health_check="/health",
        name=NAME,
        workdir=APPS,
    )
    try:
        yield app, port
    finally:
        app.teardown()


def test_a_served_app_answers_at_a_local_url_through_its_pod_server(served) -> None:
    app, port = served
    (started,) = app.start(env={"MODE": "ok"})
    assert (started["pod"], started["port"]) == (f"{NAME}-0", port)
    assert str(app.local_port()) in app.url and app.url.startswith("http://127.0.0.1:")
    assert app.local_port() != port  # the forward's own port, not the app's
    with httpx.Client(base_url=app.url, timeout=30) as http:
        hello = http.get("/hello")
        assert (hello.status_code, hello.text) == (200, f"hello from pod {NAME}-0")
        body = os.urandom(3 << 20)  # streamed both ways, byte for byte
        echoed = http.post("/echo", content=body)
        assert echoed.content == body, echoed.text[:300]
        streamed = http.get("/stream")
        assert streamed.text == "".join(f"line {i}\n" for i in range(500))
        seen = {k.lower() for k in http.get("/headers").json()}
        assert TOKEN_HEADER.lower() not in seen, "the deployment token reached the app"
        assert http.get("/health").text == "ok"


def test_the_pod_servers_port_route_needs_the_token_and_names_a_dead_port(served) -> None:
    app, port = served
    app.start(env={"MODE": "ok"})
    applied = app._remote.deployment.applied
    pod = applied.endpoints[0].url
    token = {TOKEN_HEADER: bearer(applied.token)}
    with httpx.Client(timeout=30, trust_env=False) as http:
        assert http.get(f"{pod}/ports/{port}/hello").status_code == 401
        assert http.get(f"{pod}/ports/{port}/hello", headers=token).status_code == 200
        assert http.get(f"{pod}/ports/http/x", headers=token).status_code == 400
        dead = http.get(f"{pod}/ports/{_free_port()}/x", headers=token)
    assert dead.status_code == 502, dead.text
    assert "nothing listens on port" in dead.json()["detail"]
    assert dead.headers["x-ktlite-error"] == "port_unreachable"
    assert applied.token not in dead.text


def test_ktlite_port_forward_serves_the_pods_port_here(served) -> None:
    app, port = served
    app.start(env={"MODE": "ok"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", "port-forward", NAME, f"0:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "ktlite port-forward printed nothing in 60 s"
        line = proc.stdout.readline()
        if not line:  # it ended: say why
            raise AssertionError(f"ktlite port-forward exited: {proc.communicate(timeout=10)[1]}")
        assert line.startswith("forwarding http://127.0.0.1:"), line
        url = line.split()[1]
        answer = httpx.get(url + "/hello", timeout=30)
        assert (answer.status_code, answer.text) == (200, f"hello from pod {NAME}-0")
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # and its pipes closed


def test_a_command_that_exits_fails_the_start_with_its_last_lines(served) -> None:
    app, port = served
    with pytest.raises(ReplicaFailed) as info:
        app.start(env={"MODE": "exit"})
    msg = str(info.value)
    assert f"exited with code 3 before port {port} answered" in msg, msg
    assert "cannot start: MODE=exit" in msg, msg
    assert info.value.exit_code == 3


def test_a_health_check_that_never_passes_fails_the_start_naming_its_last_answer(served) -> None:
    app, port = served
    with pytest.raises(ReplicaFailed) as info:
        app.start(env={"MODE": "sick"}, timeout=3)
    msg = str(info.value)
    assert f"port {port} did not answer GET /health with a 2xx within" in msg, msg
    assert "GET /health answered 503" in msg, msg
    assert "echo_app: serving on" in msg, msg  # the command's own lines
    # and the sick command was stopped: the port is free for the next start
    app.start(env={"MODE": "ok"})


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"port": 0}, "port=0 must be the port number"),
        ({"port": "8000"}, "port='8000' must be the port number"),
        ({"port": True}, "port=True must be the port number"),
        ({"port": 8000, "health_check": "health"}, "must be a path on the app"),
        ({"health_check": "/health"}, "needs port="),
        ({"port": 8000, "replicas": 2}, "cannot each listen on port 8000"),
    ],
)
def test_port_and_health_check_are_checked_before_anything_is_deployed(kwargs, says) -> None:
    with pytest.raises(ConfigError, match=says):
        kt.app(cli_command="python serve.py", name="never-deployed", **kwargs)


def test_a_local_url_before_the_app_is_started_says_so() -> None:
    app = kt.app(cli_command="python serve.py", port=8000, name="never-started")
    with pytest.raises(ConfigError, match="is not started"):
        app.local_port()
    plain = kt.app(cli_command="python train.py", name="never-started")
    with pytest.raises(ConfigError, match="serves no port"):
        plain.start()


def test_kubetorchs_example_under_ktlite_run_starts_the_server_and_returns() -> None:
    # examples/served_app.py: Kubetorch's form, only the import changed
    port = _free_port()
    cli = [sys.executable, "-m", "ktlite.commands.cli"]
    try:
        run = subprocess.run(
            [*cli, "run", "python", "served_app.py", "--port", str(port)],
            cwd=EXAMPLES,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr
        assert f"serving port {port} on 1 replica(s)" in run.stderr, run.stderr
        assert f"ktlite port-forward served-hello {port}" in run.stderr, run.stderr
        # it serves after `ktlite run` has returned, until torn down
        where = argparse.Namespace(
            name="served-hello", ports=f"0:{port}", replica=0, backend=None, namespace=None
        )
        forward, pod = portforward_cli.forward(where)  # what `ktlite port-forward` runs
        try:
            answer = httpx.get(forward.url + "/", timeout=30)
        finally:
            forward.close()
        assert pod == "served-hello-0"
        assert answer.json() == {"hello": "from a pod", "pod": "served-hello-0"}
    finally:
        subprocess.run([*cli, "teardown", "served-hello"], capture_output=True, timeout=120)


def test_a_local_connection_that_sends_nothing_is_closed_after_the_idle_timeout() -> None:
    """A client that connects to the forward and goes quiet does not hold a thread forever."""
    from ktlite.net.portforward import PortForward

    forward = PortForward("http://127.0.0.1:9", 80, "not-used", idle_timeout=0.3)
    forward.start()
    try:
        with socket.create_connection(("127.0.0.1", forward.local_port), timeout=30) as quiet:
            quiet.sendall(b"GET /half")  # a request head that never ends
            try:
                closed = quiet.recv(1) == b""
            except TimeoutError:
                closed = False
            assert closed, "the forward kept a silent connection open for 30 s"
    finally:
        forward.close()
