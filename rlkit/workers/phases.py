"""Runs on every rank: seconds and memory per phase, reported with each role's result."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class PhaseReport:
    """What a rank reports with every result: seconds per inner phase and its memory (MiB) at the end."""

    times: dict[str, float] = field(default_factory=dict)
    """Seconds in each phase of the call ("generate", "update", "sync", ...), the device synchronised."""
    memory_mb: dict[str, float] = field(default_factory=dict)
    """rss, and on CUDA allocated / reserved / peak (rlkit.diagnostics.memory_mb)."""


class PhaseClock:
    """Times phases on one device; :meth:`timed` synchronises CUDA so GPU work is counted where it ran."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}

    def start(self) -> None:
        """Forget the previous call's phases."""
        self.times = {}

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - begin
