"""Out-of-memory on a worker: recognising it, and the memory report that goes with the error.

A call that fails with ``torch.OutOfMemoryError`` (CUDA), ``MemoryError`` or torch's CPU allocator
error (a ``RuntimeError`` saying "DefaultCPUAllocator: can't allocate memory") is reported to the
controller with this rank's memory at the moment of failure (``report``): the torch CUDA allocator's
figures on CUDA, the process's resident memory and the host's available memory, then every report
registered with ``WorkerContext.set_memory_report`` (the roles' own tables: parameters, gradients,
optimizer state, activations, engine). The controller raises ``WorkerOutOfMemory``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)

CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
GIB = 2**30


def is_out_of_memory(exc: BaseException) -> bool:
    """True if ``exc``, or an exception it was raised from (``__cause__``/``__context__``), is an
    allocation failure: CUDA, torch's CPU allocator, or Python's ``MemoryError``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def report(device: torch.device, reports: Mapping[str, Callable[[], Any]]) -> str:
    """This rank's memory, as text: the device's allocator (CUDA), this process and the host, then
    each registered report under its name."""
    lines = []
    if device.type == "cuda":
        lines.append(f"{device} (torch allocator): {_cuda_figures(device)}")
    host = psutil.virtual_memory()
    lines.append(f"host: this process {psutil.Process().memory_info().rss / GIB:.2f} GiB resident; "
                 f"{host.available / GIB:.2f} GiB of {host.total / GIB:.2f} GiB available")
    for name, fn in reports.items():
        lines.append(f"{name}:")
        lines += ["  " + line for line in _registered(name, fn).splitlines()]
    return "\n".join(lines)


def _cuda_figures(device: torch.device) -> str:
    try:
        free, total = torch.cuda.mem_get_info(device)
        return (f"allocated {torch.cuda.memory_allocated(device) / GIB:.2f} GiB, reserved "
                f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB, peak allocated "
                f"{torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB; the device has "
                f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB")
    except Exception as exc:  # noqa: BLE001 - the report must not hide the out-of-memory error
        return f"(unavailable: {type(exc).__name__}: {exc})"


def _registered(name: str, fn: Callable[[], Any]) -> str:
    """One registered report as text: a string as it is, a mapping as ``key: value`` lines (floats
    with 2 decimals), anything else (e.g. a pandas DataFrame) as ``str()`` gives it."""
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the report must not hide the out-of-memory error
        logger.exception("the memory report %r failed", name)
        return f"(the report failed: {type(exc).__name__}: {exc})"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "\n".join(f"{key}: {v:.2f}" if isinstance(v, float) else f"{key}: {v}" for key, v in value.items())
    return str(value)
