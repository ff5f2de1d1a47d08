"""A TCP relay that records every byte it passes: what a sniffer on the wire would read.

``Relay(port)`` listens on a loopback port of its own and forwards each connection to
``127.0.0.1:port``; ``seen()`` is everything that crossed it, both ways, so far. A byte is
recorded before it is passed on: once a response came back through the relay, the request
that caused it is in ``seen()``.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._bytes = bytearray()
        self._sockets: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self._bytes)

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                outbound = socket.create_connection(self._target, timeout=30)
            except OSError:
                inbound.close()
                continue
            outbound.settimeout(None)
            with self._lock:
                self._sockets += [inbound, outbound]
                self.connections += 1
            for src, dst in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    self._bytes += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
