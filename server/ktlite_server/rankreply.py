"""What a rank process does before it answers a call: its value's bytes, and its output
flushed so that the call's last lines reach the pod server before its result.

A call's value travels in one message; a plain one (None, a number, a short string: what most
calls return) is pickled by the C pickler alone, the same bytes ``codec.dumps_parts`` makes
without building its cloudpickle pickler per call, and None's message is made once.

A rank starts with ``PYTHONUNBUFFERED``: its standard streams write through to their pipes, so
flushing them has nothing to do while they are the ones it started with and still write
through (``reconfigure`` can change that); a stream the user put in their place is flushed.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

from ktlite_wire import codec, envelope
from ktlite_wire.version import PROTOCOL_VERSION

PLAIN = (type(None), bool, int, float)  # and str/bytes under PLAIN_MAX
PLAIN_MAX = 4096


def is_plain(value: Any) -> bool:
    kind = type(value)
    return kind in PLAIN or (kind in (str, bytes) and len(value) < PLAIN_MAX)


def plain_value(value: Any) -> bytes:
    """A plain value's message in one piece: ``envelope.join(codec.dumps_plain(value))``."""
    p = pickle.dumps(value, 5)
    return envelope.HEAD.pack(codec.MAGIC, PROTOCOL_VERSION, 0, len(p)) + p


NONE_VALUE = plain_value(None)  # what most calls return


def encoded(value: Any) -> list[Any]:
    """A value's message parts (a plain one without cloudpickle's pickler)."""
    if is_plain(value):
        return [plain_value(value)]
    return codec.dumps_parts(value)


def _direct(stream: Any) -> Any:
    """``stream`` if its writes reach its file at once when it writes through (a text layer
    over an unbuffered file), else None."""
    ok = type(stream) is io.TextIOWrapper and type(stream.buffer) is io.FileIO
    return stream if ok else None


_direct_streams: list[Any] = [None, None]  # this process's own, once :func:`note_streams` ran


def note_streams() -> None:
    """Remember the standard streams the process starts with (see the module docstring)."""
    _direct_streams[:] = [_direct(sys.stdout), _direct(sys.stderr)]


def flush() -> None:
    """Flush stdout and stderr where a write may still be held in them."""
    out: Any = sys.stdout
    err: Any = sys.stderr
    direct = _direct_streams
    if out is direct[0] and err is direct[1] and out.write_through and err.write_through:
        return  # every write already went to the pipe
    for stream in (out, err):
        if stream is not None and stream in direct and stream.write_through:
            continue
        try:  # noqa: SIM105 - contextlib.suppress costs more than the flush
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the user replaced or closed
            pass
