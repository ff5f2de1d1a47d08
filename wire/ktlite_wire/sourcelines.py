"""Source lines that travel with code pickled by value (stdlib + cloudpickle only).

A traceback shows a frame's source line by asking ``linecache`` for its ``co_filename``. On
a pod that file does not exist: it is the caller's script, local module or notebook cell.
So each code object cloudpickle ships by value carries the lines of its file, taken from
the caller's ``linecache`` (which also holds IPython cells), and unpickling it registers
them in the pod's ``linecache``. A remote traceback then reads as if it had run locally.

Every code object of a file refers to one cached object holding its text, so pickle
memoization ships a file's lines once per message, however many functions of that file it
holds.
"""

from __future__ import annotations

import linecache
import types
from collections import ChainMap
from typing import Any

import cloudpickle

MAX_FILE = 2 << 20  # characters: a larger file ships no lines (a traceback loses its text)


def register(filename: str, lines: list[str]) -> None:
    """Make ``lines`` the source of ``filename`` in this process's ``linecache``.

    The mtime ``None`` tells ``linecache.checkcache`` to keep the entry: there is no file
    here to compare it with.
    """
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def register_text(filename: str, text: str) -> None:
    """Register a whole file's text, split into lines the way ``linecache`` reads a file."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    register(filename, lines)


class _Source:
    """A file's text, pickled as a call that registers it. One object per file, so pickle
    memoizes it: a message holds the text once and registers it once when unpickled."""

    __slots__ = ("filename", "text")

    def __init__(self, filename: str, text: str) -> None:
        self.filename, self.text = filename, text

    def __reduce__(self) -> tuple[Any, ...]:
        # one string, not a list of lines: a memo slot per line would push every later
        # back-reference in the message past the one-byte ones
        return register_text, (self.filename, self.text)


# filename -> (the linecache lines it was made from, its _Source or None when not shipped)
_sources: dict[str, tuple[list[str], _Source | None]] = {}
# filenames linecache could not read: asking again on every pickle costs a stat per
# sys.path entry; a file that appears in linecache later is still found (checked first)
_unreadable: set[str] = set()


def _source(filename: str) -> _Source | None:
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) != 4:  # absent, or a lazy entry not loaded yet
        if filename in _unreadable:
            return None
        linecache.getlines(filename)  # reads the file into the cache, if there is one
        entry = linecache.cache.get(filename)
        if entry is None or len(entry) != 4:
            _unreadable.add(filename)
            return None
    lines = entry[2]
    known = _sources.get(filename)
    if known is not None and known[0] is lines:
        return known[1]
    text = "".join(lines)
    source = _Source(filename, text) if text and len(text) <= MAX_FILE else None
    _sources[filename] = (lines, source)
    return source


def _rebuild_code(
    registered: None, make: Any, args: tuple[Any, ...], filename: str | None = None
) -> types.CodeType:
    # ``registered``: what unpickling the file's _Source gave, once its text is in linecache
    code: types.CodeType = make(*args)
    if filename is not None and code.co_filename != filename:
        code = code.replace(co_filename=filename)  # cloudpickle >= 3.1.3 ships "<dynamic-code>"
    return code


_reduce_code_plain = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _reduce_code(code: types.CodeType) -> Any:
    make, args = _reduce_code_plain(code)
    source = _source(code.co_filename)
    if source is None and code.co_filename in args:
        return make, args  # this cloudpickle keeps the file name and there are no lines to send
    # cloudpickle 3.1.3 replaces the file name by "<dynamic-code>": give it back, or a remote
    # traceback could show neither the file nor its lines
    return _rebuild_code, (source, make, args, code.co_filename)


# cloudpickle's table with the code reducer replaced, as flat as cloudpickle's own: a
# message without code objects looks up types in the same number of maps, so it costs the
# same (the table is only consulted for types pickle does not handle itself)
_maps = cloudpickle.Pickler.dispatch_table.maps
DISPATCH_TABLE: ChainMap[Any, Any] = ChainMap(
    {**_maps[0], types.CodeType: _reduce_code}, *_maps[1:]
)


def forget_stale() -> None:
    """Drop the caller's cached lines of files changed on disk since they were read, as a
    local traceback would (``linecache.checkcache``), so shipped lines match the files now.
    A stat per cached file: for a deploy, not for every call."""
    linecache.checkcache()
    _unreadable.clear()


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no type hints
    """cloudpickle, with the source lines of every code object it pickles by value."""

    dispatch_table = DISPATCH_TABLE
