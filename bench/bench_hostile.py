"""Hostile input against one local pod server: the figures of issue 24's "hole".

Starts ``python -m ktlite_server`` on loopback (no code deployed, a random token) and
measures, with no token sent anywhere:

- header size vs time until the server answers or closes the connection;
- slowloris: connections sending one header byte every ``--drip`` seconds, how many are
  still open after ``--hold`` seconds;
- an idle connection (sends nothing): still open after ``--hold`` seconds?
- ``/health`` latency while two clients send huge headers;
- how much of a 256 MiB body a server reads before it answers 401 and closes.

Numbers are reported, never asserted. Every wait is bounded (``--cap`` seconds).

    python bench/bench_hostile.py                 # 64 KiB .. 16 MiB headers
    python bench/bench_hostile.py --sizes 1,16,64 # MiB
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    ready = tempfile.mktemp(prefix="ktlite-hostile-", suffix=".json")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ready-file",
            ready,
        ],
        env={**os.environ, **env, "KTLITE_TOKEN": secrets.token_hex(16)},
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the pod server did not start within 60 s")
        time.sleep(0.05)
    with open(ready) as f:
        port = int(json.load(f)["port"])
    os.unlink(ready)
    return proc, port


def huge_header(port: int, size: int, cap: float) -> tuple[float, str]:
    """Send a GET whose one header is ``size`` bytes; seconds until an answer or a close."""
    s = socket.create_connection(("127.0.0.1", port), timeout=cap)
    start = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: "
    chunk = b"a" * (1 << 20)
    how = "answered"
    try:
        s.sendall(head)
        left = size
        while left > 0:
            s.sendall(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        s.sendall(b"\r\n\r\n")
        got = s.recv(200)
        how = got.split(b"\r\n", 1)[0].decode() if got else "closed"
    except (BrokenPipeError, ConnectionResetError):
        how = "closed while sending"
    except TimeoutError:
        how = f"no answer within {cap:g}s"
    finally:
        s.close()
    return time.monotonic() - start, how


def slowloris(port: int, n: int, drip: float, hold: float) -> int:
    """``n`` connections each sending a header byte every ``drip`` s; how many are open after ``hold`` s."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nx-a: ")
        socks.append(s)
    end = time.monotonic() + hold
    alive = set(range(n))
    while time.monotonic() < end:
        time.sleep(min(drip, max(0.0, end - time.monotonic())))
        for i in list(alive):
            try:
                socks[i].sendall(b"a")
            except OSError:
                alive.discard(i)
    for i in list(alive):  # a closed peer shows as EOF on read
        socks[i].setblocking(False)
        with contextlib.suppress(BlockingIOError):
            if socks[i].recv(1) == b"":
                alive.discard(i)
        with contextlib.suppress(OSError):
            socks[i].sendall(b"a")
    for s in socks:
        s.close()
    return len(alive)


def idle_open_after(port: int, hold: float) -> str:
    """Whether a connection that sends nothing is still open after ``hold`` s, and what it got."""
    s = socket.create_connection(("127.0.0.1", port), timeout=hold)
    start, got = time.monotonic(), b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return "yes"
    except OSError:
        pass
    finally:
        s.close()
    answer = got.split(b"\r\n", 1)[0].decode() or "nothing"
    return f"no: closed after {time.monotonic() - start:.1f}s, answered {answer!r}"


def health_latency(port: int, cap: float) -> float:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=cap) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        while s.recv(65536):
            pass
    return time.monotonic() - start


def body_before_401(port: int, size: int, cap: float) -> tuple[int, str]:
    """Bytes of a ``size`` body the client could send, and what the server answered."""
    s = socket.create_connection(("127.0.0.1", port), timeout=cap)
    s.sendall(f"POST /call HTTP/1.1\r\nhost: x\r\ncontent-length: {size}\r\n\r\n".encode())
    sent, answer = 0, ""
    chunk = b"\0" * (1 << 20)
    s.setblocking(False)
    deadline = time.monotonic() + cap
    try:
        while sent < size and time.monotonic() < deadline:
            try:
                sent += s.send(chunk[: size - sent])
            except BlockingIOError:
                time.sleep(0.01)
            with contextlib.suppress(BlockingIOError):
                got = s.recv(200)
                if got and not answer:
                    answer = got.split(b"\r\n", 1)[0].decode()
                if got == b"":
                    answer = answer or "closed"
                    break
    except (BrokenPipeError, ConnectionResetError):
        answer = answer or "closed"
    finally:
        s.close()
    return sent, answer or f"nothing within {cap:g}s"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="0.0625,1,4,16", help="header sizes in MiB, comma-separated")
    p.add_argument("--slowloris", type=int, default=50)
    p.add_argument("--drip", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=30.0)
    p.add_argument("--cap", type=float, default=120.0, help="longest wait for any one answer")
    args = p.parse_args()
    proc, port = start_server({})
    try:
        print(f"pod server pid {proc.pid} on 127.0.0.1:{port}")
        print(f"/health alone: {health_latency(port, args.cap):.3f}s")
        for mib in (float(x) for x in args.sizes.split(",")):
            took, how = huge_header(port, int(mib * (1 << 20)), args.cap)
            print(f"header {mib:g} MiB: {took:.3f}s ({how})")
        big = int(max(float(x) for x in args.sizes.split(",")) * (1 << 20))
        attackers = [
            threading.Thread(target=huge_header, args=(port, big, args.cap)) for _ in range(2)
        ]
        for t in attackers:
            t.start()
        # at least one sample, even when the attackers are cut off at once
        worst = health_latency(port, args.cap)
        while any(t.is_alive() for t in attackers):
            worst = max(worst, health_latency(port, args.cap))
            time.sleep(0.2)
        print(f"/health while 2 clients send {big >> 20} MiB headers: worst {worst:.3f}s")
        sent, answer = body_before_401(port, 256 << 20, min(args.cap, 30.0))
        print(f"256 MiB body without a token: {sent >> 20} MiB sent before '{answer}'")
        print(
            f"idle connection still open after {args.hold:g}s: {idle_open_after(port, args.hold)}"
        )
        left = slowloris(port, args.slowloris, args.drip, args.hold)
        print(
            f"slowloris: {left} of {args.slowloris} still open after {args.hold:g}s (a byte every {args.drip:g}s)"
        )
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
