"""The rank process's end of the rank channel (``ktlite_wire.rankchannel``): blocking
messages over its socket, or its pod server's doorbell waited on instead (a call to many ranks
wakes them all at once: ``ktlite_server.doorbell``)."""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Protocol

from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.rankchannel import (
    JOIN_MAX,
    LEN,
    MAX_MESSAGE,
    PIECE,
    READ,
    WAIT_S,
    Message,
    decode,
    encode,
    message_size,
)


class Bell(Protocol):
    """What a rank waits on instead of its channel (``ktlite_server.doorbell``)."""

    @property
    def generation(self) -> int: ...

    def wait(self, generation: int, bit: int, timeout: float = ...) -> None: ...


class Channel:
    """The rank process's end: blocking messages over a socket; sends from several threads
    (concurrent calls) never interleave. With a ``bell`` it waits on that, not on the socket,
    and reads the socket without blocking: the pod server writes every rank's message of a
    call, then wakes them all at once (``ktlite_server.doorbell``)."""

    def __init__(self, sock: socket.socket, bell: Bell | None = None, bit: int = 1) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.bell = bell
        self.bit = bit
        self._buf = bytearray()  # bytes read and not yet handed on as a message
        self._chunk = bytearray(READ)
        self._chunk_view = memoryview(self._chunk)
        self._seen: int | None = None  # the bell's generation before the last read
        # without a bell, wait for bytes in poll() before reading, not in a blocking read: a
        # reader blocked on a unix socket is also woken when the pod server reads what this
        # end sent (the kernel's wake for write space ignores what a reader waits for), so a
        # blocking read woke twice per call; a poll for POLLIN wakes for bytes (or an EOF) alone
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def send_frame(self, data: bytes) -> None:
        """Send one message's bytes, length prefix included (:func:`result_frame`)."""
        with self._send_lock:
            self.sock.sendall(data)

    def send(self, msg: Message) -> None:
        parts = encode(msg)
        data = envelope.join(parts) if message_size(parts) <= JOIN_MAX else None
        with self._send_lock:
            if data is not None:
                self.sock.sendall(data)
                return
            for p in parts:
                self.sock.sendall(p)

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message (each in a writable buffer of its own); None once ``timeout``
        seconds passed without one (a message begun is read whole)."""
        buf = self._buf
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(buf) >= LEN.size:
                (n,) = LEN.unpack_from(buf)
                if n > MAX_MESSAGE:
                    raise ProtocolError(f"a rank channel message claims {n} bytes")
                end = LEN.size + n
                if len(buf) >= end:
                    body = buf[LEN.size : end]
                    del buf[:end]
                    return decode(body)
                if n > READ:  # the rest straight into its own buffer
                    have = buf[LEN.size :]
                    buf.clear()
                    return decode(self._rest(have, n))
            k = self._fill(deadline)
            if k is None:
                return None
            if not buf and k > LEN.size:  # the usual: one read, one whole message
                (n,) = LEN.unpack_from(self._chunk)
                if k == LEN.size + n:
                    return decode(self._chunk[LEN.size : k])  # a copy: its own buffer
            buf += self._chunk_view[:k]

    def _fill(self, deadline: float | None) -> int | None:
        """Read what came into the chunk: how many bytes (0: none yet, read again), None:
        nothing came before ``deadline``."""
        bell = self.bell
        if bell is None or self._buf:  # a message's rest is on its way: no ring announces it
            if not self._buf and not self._readable(deadline):
                return None
            k = self.sock.recv_into(self._chunk)
        else:
            if self._seen is not None:  # wait for a ring since the last read
                wait = WAIT_S if deadline is None else min(WAIT_S, deadline - time.monotonic())
                if wait > 0:
                    bell.wait(self._seen, self.bit, wait)
            self._seen = bell.generation
            try:
                k = self.sock.recv_into(self._chunk, READ, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return 0 if deadline is None or time.monotonic() < deadline else None
        if k == 0:
            raise EOFError("the pod server closed the control channel")
        return k

    def _readable(self, deadline: float | None) -> bool:
        """Whether the socket has bytes (or its EOF, or an error) before ``deadline`` (None:
        wait as long as it takes; no bell to wait on)."""
        if deadline is None:
            return bool(self._poll.poll())
        return bool(self._poll.poll(max(0.0, deadline - time.monotonic()) * 1000))

    def _rest(self, have: bytearray, n: int) -> bytearray:
        """A message of ``n`` bytes whose first ones are ``have``, read whole."""
        if n > PIECE:  # a length no byte has backed yet: grow with what arrives
            return self._growing(have, n)
        buf = bytearray(n)
        buf[: len(have)] = have
        view = memoryview(buf)
        got = len(have)
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the pod server closed the control channel")
            got += k
        return buf

    def _growing(self, buf: bytearray, n: int) -> bytearray:
        piece = bytearray(PIECE)
        view = memoryview(piece)
        while len(buf) < n:
            k = self.sock.recv_into(view, min(PIECE, n - len(buf)))
            if k == 0:
                raise EOFError(
                    f"the pod server closed the control channel {len(buf)} bytes into a "
                    f"message of {n}"
                )
            buf += view[:k]
        return buf
