"""Per-rank memory: readings, marks at phase boundaries with a breakdown, and scaling against the ideal 1/N."""

from __future__ import annotations

import math
import socket
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import pandas as pd
import psutil
import torch
from torch import nn

MiB = 2**20


def memory_mb(device: torch.device) -> dict[str, float]:
    """This process's memory in MiB: RSS always; allocated / reserved / peak on a CUDA device."""
    out = {"rss": psutil.Process().memory_info().rss / MiB}
    if device.type == "cuda":
        out["allocated"] = torch.cuda.memory_allocated(device) / MiB
        out["reserved"] = torch.cuda.memory_reserved(device) / MiB
        out["peak"] = torch.cuda.max_memory_allocated(device) / MiB
    return out


def device_memory_gib() -> float:
    """On a worker: the total memory of this process's current CUDA device, in GiB."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def host_memory() -> tuple[str, float]:
    """On a worker (or the controller): this host's name and its total memory in GiB."""
    return socket.gethostname(), psutil.virtual_memory().total / 2**30


def visible_gpu_memory_gib() -> float | None:
    """The smallest total memory of the GPUs ``nvidia-smi`` lists (GiB), without touching CUDA in this process;
    None without nvidia-smi or GPUs (a controller uses it before launch, where it must not initialise CUDA)."""
    totals = _nvidia_smi_totals_mib()
    return min(totals) / 1024 if totals else None


def visible_gpu_count() -> int | None:
    """How many GPUs ``nvidia-smi`` lists on this machine, without touching CUDA in this process; None without
    nvidia-smi or GPUs."""
    return len(_nvidia_smi_totals_mib()) or None


def _nvidia_smi_totals_mib() -> list[float]:
    """Each GPU's total memory (MiB) as ``nvidia-smi`` lists it; [] without nvidia-smi."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    return [float(v) for v in lines if v.replace(".", "", 1).isdigit()]


def storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages count once).

    DTensors count their local shard's storage; meta tensors count 0; with ``device``, only tensors there.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type == "meta" or (device is not None and t.device != device):
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


@dataclass(kw_only=True)
class MemoryMark:
    """One rank's memory at the end of a phase (MiB; NaN where the device does not report it)."""

    index: int
    """Order of the mark within the tracked period."""
    phase: str
    rss_mb: float
    """Process resident memory (CPU)."""
    allocated_mb: float
    reserved_mb: float
    peak_mb: float
    """Peak allocated since the previous mark (CUDA only)."""
    parameters_mb: float
    gradients_mb: float
    optimizer_mb: float
    engine_mb: float
    other_mb: float
    """Allocated (CUDA) or RSS (CPU) minus the four above: activations, caches, buffers, the interpreter."""
    trained_mb: float = 0.0
    """The part of parameters_mb that trains (with LoRA the adapters; the rest is the frozen base)."""


class MemoryTracker:
    """Takes :class:`MemoryMark` s at phase boundaries on one rank.

    ``models`` are the trained and frozen models (their parameters and gradients),
    ``optimizers`` their optimizers, ``engine`` the rollout engine's own model.
    Only tensors on ``device`` are counted.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        models: Sequence[nn.Module] = (),
        optimizers: Sequence[torch.optim.Optimizer] = (),
        engine: nn.Module | None = None,
    ):
        self.device = torch.device(device)
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.engine = engine
        self.marks: list[MemoryMark] = []
        self._reset_peak()

    def reset(self) -> None:
        """Forget earlier marks (call at the start of a step)."""
        self.marks = []
        self._reset_peak()

    def mark(self, phase: str) -> MemoryMark:
        """Record memory now, at the end of ``phase``."""
        mark = self.reading(phase)
        self.marks.append(mark)
        self._reset_peak()
        return mark

    def memory_mb(self) -> dict[str, float]:
        """:func:`memory_mb` now, with ``peak`` the highest allocated since :meth:`reset` (the step's true peak;
        each mark resets the device's own peak counter, so the counter alone covers only the last phase)."""
        out = memory_mb(self.device)
        if "peak" in out:
            out["peak"] = max([out["peak"], *(m.peak_mb for m in self.marks)])
        return out

    def breakdown_mb(self) -> dict[str, float]:
        """What holds this rank's memory now, in MiB (reads sizes, allocates nothing): an out-of-memory report."""
        mark = self.reading("now")
        return {
            "parameters MiB": mark.parameters_mb,
            "gradients MiB": mark.gradients_mb,
            "optimizer state MiB": mark.optimizer_mb,
            "rollout engine MiB": mark.engine_mb,
            "activations and the rest MiB": mark.other_mb,
        }

    def reading(self, phase: str) -> MemoryMark:
        """Memory now, as a mark of ``phase`` that is not kept (its index is the next mark's)."""
        params = [p for m in self.models for p in m.parameters()]
        parameters = storage_bytes(params, self.device)
        gradients = storage_bytes((p.grad for p in params), self.device)
        states = (v for opt in self.optimizers for s in opt.state.values() for v in s.values())
        optimizer = storage_bytes((v for v in states if isinstance(v, torch.Tensor)), self.device)
        engine = 0 if self.engine is None else storage_bytes(
            [*self.engine.parameters(), *self.engine.buffers()], self.device
        )
        reading = memory_mb(self.device)
        total = reading.get("allocated", reading["rss"])
        accounted = (parameters + gradients + optimizer + engine) / MiB
        return MemoryMark(
            index=len(self.marks),
            phase=phase,
            rss_mb=reading["rss"],
            allocated_mb=reading.get("allocated", math.nan),
            reserved_mb=reading.get("reserved", math.nan),
            peak_mb=reading.get("peak", math.nan),
            parameters_mb=parameters / MiB,
            gradients_mb=gradients / MiB,
            optimizer_mb=optimizer / MiB,
            engine_mb=engine / MiB,
            other_mb=total - accounted,
            trained_mb=storage_bytes([p for p in params if p.requires_grad], self.device) / MiB,
        )

    def restart_peak(self) -> None:
        """Start the next mark's peak here: after a step that only frees memory (the engine's sleep), whose level
        before it belongs to the last mark's phase, not to the next one's."""
        self._reset_peak()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def memory_table(marks_by_rank: Sequence[Sequence[MemoryMark]]) -> pd.DataFrame:
    """One row per rank and mark: rank, index, phase, then the MiB columns of :class:`MemoryMark`."""
    rows = [{"rank": rank, **asdict(m)} for rank, marks in enumerate(marks_by_rank) for m in marks]
    return pd.DataFrame(rows, columns=["rank", *MemoryMark.__dataclass_fields__])
