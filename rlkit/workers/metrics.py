"""Runs on every rank: named metric sums (and extremes) over a phase, combined over all ranks in one collective."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlkit.algos.metrics import Max, Mean, Metric


class MetricSums:
    """Adds up :class:`rlkit.algos.Mean` s by name (micro-batches, optimizer steps), on the device, and keeps the
    running extremes of :class:`~rlkit.algos.metrics.Max` and :class:`~rlkit.algos.metrics.Min` metrics.

    Every rank must add the same names. A value every rank holds alike (a global gradient norm) is
    added as ``Mean(value, 1)`` on each; a rank's part of a whole (its share of a step's loss) as
    ``Mean(part, 1 / world_size)``. A metric made with ``per_rank=True`` is also reported for each rank
    alone, as ``area/rank<r>/rest`` (e.g. ``mismatch/rank1/kl_k3`` beside ``mismatch/kl_k3``).

    Example:
        sums = MetricSums(device)
        sums.add({"actor/clipfrac": Mean(clipped_tokens, tokens)})   # per micro-batch
        metrics = sums.reduce()   # {"actor/clipfrac": total over ranks / count over ranks}
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._totals: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._min: dict[str, torch.Tensor] = {}
        self._per_rank: set[str] = set()

    def add(self, metrics: Mapping[str, Metric]) -> None:
        for name, metric in metrics.items():
            if metric.per_rank:
                self._per_rank.add(name)
            if isinstance(metric, Mean):
                self._totals[name] = self._totals.get(name, 0.0) + self._tensor(metric.total)
                self._counts[name] = self._counts.get(name, 0.0) + self._tensor(metric.count)
            elif isinstance(metric, Max):
                value = self._tensor(metric.value)
                self._max[name] = torch.maximum(self._max[name], value) if name in self._max else value
            else:
                value = self._tensor(metric.value)
                self._min[name] = torch.minimum(self._min[name], value) if name in self._min else value

    def reduce(self) -> dict[str, float]:
        """Each mean's total over its count, both summed over all ranks; each extreme over all ranks; and each
        per-rank metric's value on every rank (one all-gather, one host sync)."""
        means, highs, lows = sorted(self._totals), sorted(self._max), sorted(self._min)
        if not (means or highs or lows):
            return {}
        local = torch.stack(
            [self._totals[n] for n in means]
            + [self._counts[n] for n in means]
            + [self._max[n] for n in highs]
            + [self._min[n] for n in lows]
        )
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        ranks = torch.stack(gathered).tolist()  # [world, K]
        k, h = len(means), len(highs)
        columns = {name: [row[i] for row in ranks] for i, name in enumerate(means)}
        counts = {name: [row[k + i] for row in ranks] for i, name in enumerate(means)}
        out: dict[str, float] = {}
        per_rank: dict[str, list[float]] = {}
        for name in means:
            out[name] = _ratio(sum(columns[name]), sum(counts[name]))
            per_rank[name] = [_ratio(t, c) for t, c in zip(columns[name], counts[name], strict=True)]
        for i, name in enumerate(highs):
            per_rank[name] = [_finite(row[2 * k + i]) for row in ranks]
            out[name] = _finite(max(row[2 * k + i] for row in ranks))
        for i, name in enumerate(lows):
            per_rank[name] = [_finite(row[2 * k + h + i]) for row in ranks]
            out[name] = _finite(min(row[2 * k + h + i] for row in ranks))
        for name in sorted(self._per_rank):
            area, _, rest = name.partition("/")
            out.update({f"{area}/rank{r}/{rest}": value for r, value in enumerate(per_rank[name])})
        return out

    def _tensor(self, value: torch.Tensor | float) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float64, device=self.device)


def _ratio(total: float, count: float) -> float:
    return total / count if count else 0.0


def _finite(value: float) -> float:
    """An extreme over nothing (+-inf) as NaN."""
    return value if math.isfinite(value) else math.nan
