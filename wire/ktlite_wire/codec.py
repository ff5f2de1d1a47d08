"""User values on the wire: cloudpickle with large buffers carried out of band.

A value message has the envelope's layout (``ktlite_wire.envelope``) with a pickle stream
where a typed message has its JSON header::

    b"KTL" version:u8 nbufs:u32 pickle_len:u64 buf_len:u64*nbufs  pickle  [pad buf]*nbufs

Only the caller and the rank processes decode one: to a pod server a value is opaque bytes
(it checks the framing with :func:`check`, never unpickles). Decoding a message held in a
writable buffer gives arrays backed by that buffer: no copies.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
from typing import Any

import cloudpickle

from ktlite_wire import envelope, sourcelines

logger = logging.getLogger(__name__)

MAGIC = b"KTL"
# out-of-band threshold: smaller buffers stay in the pickle stream
_OOB_MIN = 4096
parts_size = envelope.parts_size


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no type hints
    """cloudpickle plus out-of-band buffers for torch tensors (cloudpickle copies them). A
    CUDA tensor travels as its CPU copy and the name of its device: it lands on that device
    where the receiver has it, else on the CPU (a caller without CUDA can take a rank's
    CUDA result)."""

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
    if t.layout != torch.strided or t.is_quantized:
        return None  # torch's own reduction (a sparse tensor's parts come back here)
    if t.requires_grad and t.grad_fn is not None:
        return None  # torch's own refusal of a non-leaf tensor says it best
    device = None
    if t.device.type == "cuda":
        device = str(t.device)
        data = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    elif t.device.type != "cpu" or t.is_conj() or t.is_neg():
        return None
    else:
        data = t.detach().contiguous()
    requires_grad = bool(t.requires_grad)
    dtype = str(data.dtype).removeprefix("torch.")
    as_np = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dtype)
    try:
        arr = (data.view(getattr(torch, as_np)) if as_np else data).numpy()
    except (TypeError, RuntimeError):
        return None
    is_param = type(t) is not torch.Tensor
    args: tuple[Any, ...] = (
        pickle.PickleBuffer(arr.reshape(-1).view("uint8")) if arr.size else b"",
        dtype,
        tuple(data.shape),
        requires_grad,
        is_param,
    )
    return _rebuild_tensor, (args + (device,) if device else args)


def _rebuild_tensor(
    buf: Any,
    dtype: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    is_param: bool,
    device: str | None = None,
) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    raw = (
        torch.frombuffer(buf, dtype=torch.uint8)
        if len(memoryview(buf))
        else torch.empty(0, dtype=torch.uint8)
    )
    t = raw.view(tdtype).reshape(shape)
    if device is not None:
        t = _on_device(torch, t, device)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


_warned_cpu: set[str] = set()


def _on_device(torch: Any, t: Any, device: str) -> Any:
    """``t`` (CPU) on ``device`` where this process has it, else left on the CPU (said once)."""
    index = int(device.partition(":")[2] or 0)
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        return t.to(device)
    _say_on_cpu(torch, device)
    return t


def _say_on_cpu(torch: Any, device: str) -> None:
    if device not in _warned_cpu:
        _warned_cpu.add(device)
        logger.warning(
            "a tensor that was on %s arrived in a process without that CUDA device "
            "(torch.cuda.is_available() is %s here): it is on the CPU; .to('cuda') moves it "
            "where a GPU is",
            device,
            torch.cuda.is_available(),
        )


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


def dumps_plain(obj: Any) -> list[Any]:
    """:func:`dumps_parts` of a value of builtin types alone (no code, no buffer): the C
    pickler's bytes in the same message, decoded by :func:`loads` as any other."""
    return envelope.pack(MAGIC, [pickle.dumps(obj, protocol=5)], [])


def dumps(obj: Any, *, sources: bool = False) -> bytes:
    """One message as bytes (small messages; large ones should use :func:`dumps_parts`)."""
    return envelope.join(dumps_parts(obj, sources=sources))


def loads(data: Any) -> Any:
    """Decode one message; out-of-band buffers are views of ``data`` (no copies). Only the
    caller and the rank processes call this: it runs the sender's code."""
    body, bufs = envelope.unpack(MAGIC, data, "value message")
    try:
        return pickle.loads(body, buffers=bufs) if bufs else pickle.loads(body)
    except RuntimeError as e:
        if "torch.cuda.is_available() is False" not in str(e):
            raise
    # a CUDA object pickled by torch itself (a storage, a sparse or quantized tensor: not
    # the tensors above), in a process without CUDA: load it again, onto the CPU
    return _CpuUnpickler(io.BytesIO(body), buffers=bufs).load()


def _load_storage_on_cpu(b: bytes) -> Any:
    import torch

    _say_on_cpu(torch, "cuda")
    return torch.load(io.BytesIO(b), weights_only=False, map_location="cpu")


class _CpuUnpickler(pickle.Unpickler):
    """An unpickler that loads torch's own CUDA storages onto the CPU."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_on_cpu
        return super().find_class(module, name)


def check(data: Any) -> tuple[memoryview, list[memoryview]]:
    """Check a value message's framing (magic, version, buffer table, sizes) without
    unpickling it: its pickle stream and out-of-band buffers. Raises ProtocolError."""
    return envelope.unpack(MAGIC, data, "value message")
