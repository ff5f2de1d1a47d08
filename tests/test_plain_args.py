"""A call whose arguments are builtin values alone is pickled by the C pickler, without
cloudpickle and the caller's modules registered by value (``packaging.encode_ranked_call``);
anything else (code, a per-rank marker, a buffer, a subclass, a deep or long value) takes the
general way. Both decode to the same call on a rank (``codec.loads``)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import pytest

import ktlite as kt
from ktlite.net import packaging
from ktlite_wire import codec, envelope


class Level(enum.IntEnum):
    LOW = 1


@contextlib.contextmanager
def _general_way_taken() -> Iterator[None]:
    raise RuntimeError("the general way (cloudpickle, by value) was taken")
    yield  # pragma: no cover


def _decoded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    parts, layout = packaging.encode_ranked_call("m", args, kwargs, 2)
    assert layout is None
    return codec.loads(envelope.join(parts))


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        ((1, "a", 2.5, None, True, b"bytes"), {"k": "v"}),
        (([1, 2], (3, "x"), {"a": None}), {"kw": (False, 7)}),
    ],
)
def test_builtin_arguments_skip_cloudpickle_and_decode_the_same(
    monkeypatch: pytest.MonkeyPatch, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    monkeypatch.setattr(packaging, "by_value", _general_way_taken)
    assert _decoded(args, kwargs) == ("m", args, kwargs)


def _f() -> int:
    return 1


@pytest.mark.parametrize(
    "args",
    [
        (_f,),
        (bytearray(b"buffer"),),
        (Level.LOW,),
        ([[1]],),
        (list(range(17)),),
        ({1: "int key"},),
        (kt.per_rank([1, 2]),),
    ],
)
def test_anything_else_takes_the_general_way(
    monkeypatch: pytest.MonkeyPatch, args: tuple[Any, ...]
) -> None:
    with monkeypatch.context() as m:
        m.setattr(packaging, "by_value", _general_way_taken)
        with pytest.raises(Exception, match="the general way"):
            packaging.encode_ranked_call("m", args, {}, 2)
    parts, layout = packaging.encode_ranked_call("m", args, {}, 2)  # and it works
    assert parts
