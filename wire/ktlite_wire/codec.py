"""User values on the wire: cloudpickle with large buffers carried out of band.

A value message has the envelope's layout (``ktlite_wire.envelope``) with a pickle stream
where a typed message has its JSON header::

    b"KTL" version:u8 nbufs:u32 pickle_len:u64 buf_len:u64*nbufs  pickle  [pad buf]*nbufs

Only the caller and the rank processes decode one: to a pod server a value is opaque bytes
(it checks the framing with :func:`check`, never unpickles). Decoding a message held in a
writable buffer gives arrays backed by that buffer: no copies.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import cloudpickle

from ktlite_wire import envelope, sourcelines

MAGIC = b"KTL"
# out-of-band threshold: smaller buffers stay in the pickle stream
_OOB_MIN = 4096
parts_size = envelope.parts_size


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no type hints
    """cloudpickle plus out-of-band buffers for CPU torch tensors (cloudpickle copies them)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


class _SourcePickler(_Pickler):
    """Code shipped by value carries its file's source lines (the caller's side only: what
    a pod sends back needs none, its code came from the caller)."""

    dispatch_table = sourcelines.DISPATCH_TABLE


def _reduce_tensor(torch: Any, t: Any) -> Any:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    if t.requires_grad and t.grad_fn is not None:
        return None
    if t.is_conj() or t.is_neg():
        return None
    data = t.detach().contiguous()
    dtype = str(data.dtype).removeprefix("torch.")
    as_np = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dtype)
    try:
        arr = (data.view(getattr(torch, as_np)) if as_np else data).numpy()
    except (TypeError, RuntimeError):
        return None
    is_param = type(t) is not torch.Tensor
    return _rebuild_tensor, (
        pickle.PickleBuffer(arr.reshape(-1).view("uint8")) if arr.size else b"",
        dtype,
        tuple(data.shape),
        bool(t.requires_grad),
        is_param,
    )


def _rebuild_tensor(
    buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool, is_param: bool
) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    raw = (
        torch.frombuffer(buf, dtype=torch.uint8)
        if len(memoryview(buf))
        else torch.empty(0, dtype=torch.uint8)
    )
    t = raw.view(tdtype).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pieces:
    """A pickle's output as the pieces the pickler writes, kept, not copied: the pickler hands
    a large ``bytes`` value (which no pickling hook sees: pickle always writes it in band) to
    ``write`` as the object itself, so it travels without a copy on this side, like an
    out-of-band buffer."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: Any) -> int:
        self.pieces.append(data if type(data) is bytes else bytes(data))
        return len(self.pieces[-1])


def dumps_parts(obj: Any, *, sources: bool = False) -> list[Any]:
    """Pickle ``obj`` into the parts of one message: header, pickle, then aligned buffers.

    ``sources``: code pickled by value carries its source lines, for remote tracebacks.
    """
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        if memoryview(buf).nbytes < _OOB_MIN:
            return True  # serialize in band
        buffers.append(buf)
        return False

    stream = _Pieces()
    (_SourcePickler if sources else _Pickler)(stream, protocol=5, buffer_callback=keep).dump(obj)
    return envelope.pack(MAGIC, stream.pieces, [b.raw() for b in buffers])


def dumps(obj: Any, *, sources: bool = False) -> bytes:
    """One message as bytes (small messages; large ones should use :func:`dumps_parts`)."""
    return envelope.join(dumps_parts(obj, sources=sources))


def loads(data: Any) -> Any:
    """Decode one message; out-of-band buffers are views of ``data`` (no copies). Only the
    caller and the rank processes call this: it runs the sender's code."""
    body, bufs = envelope.unpack(MAGIC, data, "value message")
    return pickle.loads(body, buffers=bufs)


def check(data: Any) -> tuple[memoryview, list[memoryview]]:
    """Check a value message's framing (magic, version, buffer table, sizes) without
    unpickling it: its pickle stream and out-of-band buffers. Raises ProtocolError."""
    return envelope.unpack(MAGIC, data, "value message")
