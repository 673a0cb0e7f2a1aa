"""Runs on every rank: named metric sums over a phase, reduced over all ranks in one collective."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlkit.algos import Mean


class MetricSums:
    """Adds up :class:`rlkit.algos.Mean` s by name (micro-batches, optimizer steps), on the device.

    Every rank must add the same names. A value every rank holds alike (a global gradient norm) is
    added as ``Mean(value, 1)`` on each; a rank's part of a whole (its share of a step's loss) as
    ``Mean(part, 1 / world_size)``.

    Example:
        sums = MetricSums(device)
        sums.add({"actor/clipfrac": Mean(clipped_tokens, tokens)})   # per micro-batch
        metrics = sums.reduce()   # {"actor/clipfrac": total over ranks / count over ranks}
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._totals: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, metrics: Mapping[str, Mean]) -> None:
        for name, mean in metrics.items():
            total = torch.as_tensor(mean.total, dtype=torch.float64, device=self.device)
            count = torch.as_tensor(mean.count, dtype=torch.float64, device=self.device)
            self._totals[name] = self._totals.get(name, 0.0) + total
            self._counts[name] = self._counts.get(name, 0.0) + count

    def reduce(self) -> dict[str, float]:
        """Each name's total over its count, both summed over all ranks (one all-reduce, one host sync)."""
        names = sorted(self._totals)
        if not names:
            return {}
        stacked = torch.stack([self._totals[n] for n in names] + [self._counts[n] for n in names])
        dist.all_reduce(stacked)
        values = stacked.tolist()
        k = len(names)
        return {name: values[i] / values[k + i] if values[k + i] else 0.0 for i, name in enumerate(names)}
