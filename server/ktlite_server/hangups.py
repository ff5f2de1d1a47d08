"""Whether the pod at the other end of a connection hung up: the kernel has its FIN or reset
and the event loop has not read it yet (it reads the socket only on its next pass, which a
call's quorum check can come before)."""

from __future__ import annotations

import select
import socket
from typing import Any

_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


def peer_closed(raw: socket.socket | None) -> bool:
    """Whether the kernel has the peer's end of this connection (its FIN, or a reset) that
    the loop has not read yet: a peek at the socket (nothing else queued before it)."""
    if raw is None:
        return False
    try:  # the loop's socket object cannot recv: peek through a duplicate of its fd
        with socket.socket(fileno=socket.dup(raw.fileno())) as dup:
            return dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing queued
    except OSError:
        return True  # reset


def hung_up(socks: list[Any]) -> list[bool]:
    """For each socket, whether its peer hung up (its FIN or a reset is queued): one ``poll``
    for all of them (a FIN queued after data counts: the pod is closing)."""
    if not socks:
        return []
    poller = select.poll()
    fds = [s.fileno() for s in socks]
    for fd in fds:
        poller.register(fd, _HUNG_UP)
    gone = {fd for fd, events in poller.poll(0) if events & _HUNG_UP}
    return [fd in gone for fd in fds]
