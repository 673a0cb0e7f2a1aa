"""Metrics as sums and counts (and extremes), so the parts of a batch (micro-batches, ranks) combine first."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mean:
    """A mean kept as ``total / count``; adding the totals and counts of parts gives the whole's mean.

    Both are 0-dim tensors (on the device where they were made, so no host sync) or floats. ``per_rank``:
    the reduction also reports each rank's own mean (``area/rank<r>/rest`` beside ``area/rest``).

    Example:
        >>> parts = [Mean(torch.tensor(3.0), torch.tensor(2.0)), Mean(torch.tensor(1.0), torch.tensor(2.0))]
        >>> float(sum(p.total for p in parts) / sum(p.count for p in parts))  # (3 + 1) / (2 + 2)
        1.0
    """

    total: torch.Tensor | float
    count: torch.Tensor | float
    per_rank: bool = False


@dataclass(frozen=True)
class Max:
    """The largest value of a part (-inf for an empty part); parts combine by max, ranks too.
    ``per_rank`` as in :class:`Mean`."""

    value: torch.Tensor | float
    per_rank: bool = False


@dataclass(frozen=True)
class Min:
    """The smallest value of a part (+inf for an empty part); parts combine by min, ranks too."""

    value: torch.Tensor | float
    per_rank: bool = False


Metric = Mean | Max | Min
"""What a phase's named metrics hold before the reduction over micro-batches and ranks."""


def token_mean(values: torch.Tensor, mask: torch.Tensor, *, per_rank: bool = False) -> Mean:
    """The mean of ``values`` over the tokens where ``mask`` is 1 ([b, T] each), detached; padding may hold NaN."""
    keep = mask > 0
    return Mean(torch.where(keep, values.detach(), 0.0).sum(), keep.sum(), per_rank)


def token_max(values: torch.Tensor, mask: torch.Tensor, *, per_rank: bool = False) -> Max:
    """The largest of ``values`` where ``mask`` is 1 ([b, T] each), detached; -inf for an empty mask."""
    return Max(torch.where(mask > 0, values.detach().float(), -torch.inf).max(), per_rank)


def token_min(values: torch.Tensor, mask: torch.Tensor, *, per_rank: bool = False) -> Min:
    """The smallest of ``values`` where ``mask`` is 1 ([b, T] each), detached; +inf for an empty mask."""
    return Min(torch.where(mask > 0, values.detach().float(), torch.inf).min(), per_rank)
