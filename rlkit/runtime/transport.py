"""Pickling for calls and results: cloudpickle, with tensor data kept out of the pickle.

Functions and arguments travel by value (cloudpickle), so functions defined in a notebook cell or
in ``__main__`` work on the workers. Tensors under ``INLINE_MAX_BYTES`` travel inline; the data of
larger ones does not go through the pickle:

- local backend (``TensorFiles``): the sender writes each tensor's data once into its own file
  under ``/dev/shm`` (straight from its device, whatever its strides) and pickles only
  ``(path, dtype, shape)``; the receiver maps the file copy-on-write with
  ``torch.from_file(shared=False)``, which copies nothing.
- Ray backend (``OutOfBand``): each tensor's bytes become one pickle-protocol-5 out-of-band buffer
  (a numpy array, which Ray's object store holds without copying); ``loads(data, buffers)``
  copies each buffer once into a fresh tensor (the store's copy is read-only).

Received tensors are contiguous, on the CPU, detached (``requires_grad=False``: autograd graphs do
not cross processes) and independent of each other (views are not preserved).
"""

from __future__ import annotations

import io
import marshal
import math
import os
import pickle
import tempfile
import types
import uuid
from typing import Any

import cloudpickle
import torch

INLINE_MAX_BYTES = 64 * 1024


def shm_dir() -> str:
    """Where tensor files go: ``/dev/shm`` (RAM-backed) where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class TensorFiles:
    """The shared-memory files written while pickling one message, and their removal.

    ``reader_unlinks=True``: the (single) receiver deletes each file as soon as it has mapped it;
    used for results. ``False``: several ranks read the same files (call arguments are written
    once for all ranks), so the sender calls ``remove()`` once every rank has loaded them.
    """

    def __init__(self, prefix: str, reader_unlinks: bool) -> None:
        self.prefix = prefix
        self.reader_unlinks = reader_unlinks
        self.paths: list[str] = []
        # id(tensor) -> (tensor, ref); holding the tensor keeps its id from being reused.
        self._refs: dict[int, tuple[torch.Tensor, tuple]] = {}

    def ref(self, tensor: torch.Tensor) -> tuple:
        """A picklable reference to ``tensor``'s data, writing it once per ``TensorFiles``."""
        hit = self._refs.get(id(tensor))
        if hit is None:
            hit = self._refs[id(tensor)] = (tensor, self._write(tensor.detach()))
        return hit[1]

    def remove(self) -> None:
        """Delete the files written so far that are still present."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths.clear()
        self._refs.clear()

    def _write(self, t: torch.Tensor) -> tuple:
        shape = tuple(t.shape)
        if _is_small(t):
            return _inline_ref(t)
        nbytes = t.numel() * t.element_size()
        path = f"{self.prefix}{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.paths.append(path)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(shape).copy_(t)
        return ("shm", t.dtype, shape, path, self.reader_unlinks)


class OutOfBand:
    """Tensor data as pickle-protocol-5 out-of-band buffers (for the Ray object store).

    One ``OutOfBand`` serves every rank's payload of one call: a tensor shared by several ranks
    becomes one buffer object, so ``dumps`` returns, per payload, the buffers it uses in order and
    the caller can store each distinct buffer once (``id`` of the buffer is its identity).
    """

    def __init__(self) -> None:
        # id(tensor) -> (tensor, buffer); holding the tensor keeps its id from being reused.
        self._buffers: dict[int, tuple[torch.Tensor, Any]] = {}

    def buffer(self, tensor: torch.Tensor) -> Any:
        """``tensor``'s bytes as a flat uint8 numpy array (a copy only where it must move or be made contiguous)."""
        hit = self._buffers.get(id(tensor))
        if hit is None:
            hit = self._buffers[id(tensor)] = (tensor, _as_bytes(tensor.detach()).numpy())
        return hit[1]

    def dumps(self, obj: Any) -> tuple[bytes, list[Any]]:
        """Pickle ``obj``; returns the pickle and the buffers it refers to, in order."""
        used: list[Any] = []

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            used.append(buffer.raw().obj)
            return False  # False: the buffer is not written into the pickle

        buf = io.BytesIO()
        _Pickler(buf, self, buffer_callback=out_of_band).dump(obj)
        return buf.getvalue(), used


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The data of ``t`` as a flat contiguous uint8 CPU tensor."""
    flat = t.to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _is_small(t: torch.Tensor) -> bool:
    return t.numel() == 0 or t.numel() * t.element_size() < INLINE_MAX_BYTES


def _inline_ref(t: torch.Tensor) -> tuple:
    if t.numel() == 0:
        return ("empty", t.dtype, tuple(t.shape))
    return ("inline", t.dtype, tuple(t.shape), _as_bytes(t).numpy().tobytes())


def _tensor_from_buffer(buf: Any, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Rebuild a tensor from an out-of-band buffer, copying it once (the buffer may be read-only)."""
    src = memoryview(buf).cast("B")
    out = torch.empty(src.nbytes, dtype=torch.uint8)
    out.numpy()[:] = src
    return out.view(dtype).view(shape)


def _load_tensor(ref: tuple) -> torch.Tensor:
    """Rebuild a tensor from ``TensorFiles.ref`` output (runs on the receiving side)."""
    kind, dtype, shape = ref[:3]
    if kind == "empty":
        return torch.empty(shape, dtype=dtype)
    if kind == "inline":
        return torch.frombuffer(bytearray(ref[3]), dtype=torch.uint8).view(dtype).view(shape)
    path, unlink = ref[3], ref[4]
    tensor = torch.from_file(path, shared=False, size=math.prod(shape), dtype=dtype).view(shape)
    if unlink:
        os.unlink(path)
    return tensor


def _is_plain_tensor(obj: Any) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
            and not obj.is_quantized and not obj.is_nested and obj.device.type != "meta")


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, except that plain dense tensors become ``TensorFiles`` references."""

    def __init__(self, file: io.BytesIO, sink: TensorFiles | OutOfBand, **kwargs: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL, **kwargs)
        self._sink = sink

    def reducer_override(self, obj: Any) -> Any:
        if _is_plain_tensor(obj):
            if isinstance(self._sink, TensorFiles):
                return _load_tensor, (self._sink.ref(obj),)
            if _is_small(obj):
                return _load_tensor, (_inline_ref(obj.detach()),)
            return _tensor_from_buffer, (pickle.PickleBuffer(self._sink.buffer(obj)), obj.dtype,
                                         tuple(obj.shape))
        if isinstance(obj, types.CodeType):
            # cloudpickle drops code file names; keep them so that remote tracebacks point at the
            # source. marshal is fine: workers run the controller's interpreter.
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


class _ProbePickler(cloudpickle.CloudPickler):
    """cloudpickle with tensors replaced by None: cheap, for finding what cannot be pickled."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return type(None), ()
        return super().reducer_override(obj)


def dumps(obj: Any, files: TensorFiles) -> bytes:
    """Pickle ``obj``; its tensors are written through ``files``."""
    buf = io.BytesIO()
    _Pickler(buf, files).dump(obj)
    return buf.getvalue()


def loads(data: bytes, buffers: list[Any] | None = None) -> Any:
    """Inverse of ``dumps`` (maps, and where asked unlinks, the tensor files) and of
    ``OutOfBand.dumps`` (``buffers``: the out-of-band buffers, in order)."""
    return pickle.loads(data, buffers=buffers)


def find_unpicklable(named: list[tuple[str, Any]]) -> tuple[str, Exception] | None:
    """The first ``(name, error)`` among ``(name, object)`` pairs that cloudpickle refuses."""
    for name, obj in named:
        try:
            _ProbePickler(io.BytesIO()).dump(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is what we look for
            return name, exc
    return None
