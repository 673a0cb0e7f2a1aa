"""Metrics as sums and counts, so the parts of a batch (micro-batches, ranks) add up before one division."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mean:
    """A mean kept as ``total / count``; adding the totals and counts of parts gives the whole's mean.

    Both are 0-dim tensors (on the device where they were made, so no host sync) or floats.

    Example:
        >>> parts = [Mean(torch.tensor(3.0), torch.tensor(2.0)), Mean(torch.tensor(1.0), torch.tensor(2.0))]
        >>> float(sum(p.total for p in parts) / sum(p.count for p in parts))  # (3 + 1) / (2 + 2)
        1.0
    """

    total: torch.Tensor | float
    count: torch.Tensor | float


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> Mean:
    """The mean of ``values`` over the tokens where ``mask`` is 1 ([b, T] each), detached; padding may hold NaN."""
    keep = mask > 0
    return Mean(torch.where(keep, values.detach(), 0.0).sum(), keep.sum())
