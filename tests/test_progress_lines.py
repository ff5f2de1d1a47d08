"""What a long wait shows: a status line rewritten in place in a terminal, plain lines in a log
or notebook, nothing for a quick wait or with ``KTLITE_PROGRESS=0``; and on a real local
deployment, the pods' start. (The transfer bar's stray character: each redraw now erases the
rest of the line.)"""

from __future__ import annotations

import io

import pytest

import ktlite as kt
from ktlite.net import progress
from ktlite.net.progress import Progress, StatusLine, ticking


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_quick_wait_says_nothing() -> None:
    out, clock = io.StringIO(), Clock()
    line = StatusLine("job", out, clock)
    line.update("starting pods, 0/2 ready")
    clock.now += 0.5
    line.update("starting pods, 1/2 ready")
    line.done("2 pod(s) ready")
    assert out.getvalue() == ""


def test_a_log_gets_a_line_per_change_and_now_and_then_while_unchanged() -> None:
    out, clock = io.StringIO(), Clock()
    line = StatusLine("job", out, clock)
    line.update("starting pods, 0/2 ready")
    clock.now += 1.5
    line.tick()  # shown from here
    clock.now += 2
    line.tick()  # unchanged, too soon: nothing
    line.update("starting pods, 1/2 ready")
    clock.now += progress.PLAIN_EVERY_S
    line.tick()  # unchanged, but long enough: said again
    line.done("2 pod(s) ready")
    assert out.getvalue().splitlines() == [
        "ktlite: job: starting pods, 0/2 ready (2 s)",
        "ktlite: job: starting pods, 1/2 ready (4 s)",
        "ktlite: job: starting pods, 1/2 ready (14 s)",
        "ktlite: job: 2 pod(s) ready (14 s)",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place() -> None:
    out, clock = Terminal(), Clock()
    line = StatusLine("job", out, clock)
    line.update("forming the Ray cluster on 4 pod(s), a long text")
    clock.now += 3
    line.tick()
    clock.now += 1
    line.update("short")
    line.done("done")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("done (4 s)\x1b[K\n")
    # every redraw starts at the line's start and erases what a longer one left
    draws = text.split("\r")[1:]
    assert len(draws) == 3 and all(d.rstrip("\n").endswith("\x1b[K") for d in draws)


def test_progress_zero_silences_both(monkeypatch) -> None:
    monkeypatch.setenv("KTLITE_PROGRESS", "0")
    out, clock = Terminal(), Clock()
    line = StatusLine("job", out, clock)
    line.update("x")
    clock.now += 60
    line.done()
    bar = Progress("put k", 100 << 20, out)
    bar.add(50 << 20)
    bar.close()
    assert out.getvalue() == ""


def test_the_transfer_bar_erases_what_a_longer_draw_left(monkeypatch) -> None:
    out = Terminal()
    bar = Progress("get model", 100 << 20, out)
    bar.add(60 << 20)
    bar.close()
    draws = out.getvalue().split("\r")[1:]
    assert draws and all(d.rstrip("\n").endswith("\x1b[K") for d in draws)


def test_ticking_says_when_a_blocking_wait_ends(monkeypatch) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    out = io.StringIO()
    with ticking("job", "loading the code on 2 pod(s)", out) as line:
        line.update("loading the code on 2 pod(s), 1 ready")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ktlite: job: loading the code on 2 pod(s)")
    assert lines[-1].startswith("ktlite: job: loading the code on 2 pod(s), 1 ready (")


def hello() -> str:
    return "hi"


def test_a_local_deployment_says_its_pods_are_starting(monkeypatch, capfd) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # every wait shows, however quick
    remote = kt.fn(hello, name="pl-start").to(kt.Compute(cpus=1).distribute("spmd", workers=2))
    try:
        assert remote() == ["hi", "hi"]
    finally:
        remote.teardown()
    err = capfd.readouterr().err
    assert "ktlite: pl-start: starting pods, 0/2 ready" in err
    assert "ktlite: pl-start: 2 pod(s) ready" in err
    assert "ktlite: pl-start: loading the code on 2 pod(s)" in err


@pytest.mark.parametrize(
    ("framework", "says"),
    [("ray", "forming the Ray cluster"), ("monarch", "forming the Monarch mesh"), ("spmd", "")],
)
def test_a_code_push_names_the_formation_it_waits_for(framework, says) -> None:
    from ktlite.modes.deploy import _loading
    from ktlite.specs.deployment_spec import DeploymentSpec

    compute = kt.Compute(cpus=1).distribute(framework, workers=3)
    spec = DeploymentSpec("x", pod=compute.pod_spec())
    text = _loading(spec)
    assert text.startswith("loading the code") and text.endswith(f"on {spec.workers} pod(s)")
    assert says in text


def test_a_large_argument_shows_a_bar_as_it_goes(monkeypatch, capsys) -> None:
    """A call's body of hundreds of MB takes seconds (a GiB through a proxy, 7-14 s): sent in
    slices, with a bar (forced on here; else only once it has lasted a second)."""
    import socket
    import threading

    from ktlite.net.connection import PROGRESS_BYTES, Connection

    monkeypatch.setenv("KTLITE_PROGRESS", "1")
    listener = socket.create_server(("127.0.0.1", 0))
    size = PROGRESS_BYTES + (3 << 20)
    got = []

    def drain() -> None:
        conn, _ = listener.accept()
        with conn:
            n = 0
            while n < size + 5:  # the 5-byte head, then the body
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
            got.append(n)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    conn = Connection("127.0.0.1", listener.getsockname()[1], 10.0, None)
    try:
        conn.send(b"H\r\n\r\n", [bytearray(size)])
    finally:
        reader.join(30)
        conn.close()
        listener.close()
    assert got == [size + 5]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("sending to 127.0.0.1:")]
    assert lines and "100.0%" in lines[-1], err
    assert len(lines) >= 2, err  # a line per quarter, then the end


def test_a_small_argument_is_sent_without_a_bar(monkeypatch, capsys) -> None:
    import socket
    import threading

    from ktlite.net.connection import Connection

    monkeypatch.setenv("KTLITE_PROGRESS", "1")
    listener = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(1 << 20):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    conn = Connection("127.0.0.1", listener.getsockname()[1], 10.0, None)
    conn.send(b"H\r\n\r\n", [bytearray(8 << 20)])
    conn.close()
    reader.join(30)
    listener.close()
    assert "sending to" not in capsys.readouterr().err


def test_a_delayed_bar_stays_quiet_for_a_quick_transfer_and_shows_for_a_slow_one(
    monkeypatch,
) -> None:
    monkeypatch.delenv("KTLITE_PROGRESS", raising=False)
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    quick, slow = Terminal(), Terminal()
    bar = Progress("sending to pod", 100 << 20, quick, delay_s=1.0)
    bar.add(100 << 20)
    clock.now += 0.5
    bar.close()
    assert quick.getvalue() == ""
    bar = Progress("sending to pod", 100 << 20, slow, delay_s=1.0)
    bar.add(10 << 20)  # at once: not yet
    assert slow.getvalue() == ""
    clock.now += 1.5
    bar.add(90 << 20)
    bar.close()
    assert "sending to pod" in slow.getvalue() and "100.0%" in slow.getvalue()
