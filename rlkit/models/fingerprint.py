"""Weight fingerprints that see order: a few fixed random projections of a tensor's values, and its sum of squares.

The projections are u_k^T W v_k for a tensor viewed as a matrix W [rows, cols] (dim 0 by the rest), with u_k and
v_k drawn from a generator seeded by the shape alone, so the trainer and the engine (another process) draw the
same ones. A permutation, a transpose or fused parts stacked in the wrong order (q/k/v, gate/up) change them by
the order of ||W|| while a sum and a sum of squares stay equal. A fused engine tensor is compared part by part:
the rows where each checkpoint tensor should sit against that tensor.
"""

from __future__ import annotations

import torch

PROJECTIONS = 4
"""Random projections per tensor."""
TOLERANCE = 1e-4
"""A projection differs when |trainer - engine| exceeds this times sqrt(sum of squares) (its spread under random
u, v): the same values summed in another order agree to ~1e-6 of it in fp32, a reordering moves it by ~1."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """[PROJECTIONS + 1] float64: the projections of ``tensor`` (viewed as [r, c], r its dim 0) and its sum of
    squares."""
    matrix = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
    left, right = _draws(*matrix.shape)
    left = left.to(matrix.device)
    values = matrix.float()
    projected = ((values @ right.to(matrix.device)) * left.T).sum(dim=0)
    squares = values.double().square().sum().reshape(1)
    return torch.cat([projected.double(), squares]).cpu()


def _draws(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u [PROJECTIONS, rows] and v [cols, PROJECTIONS] (float32), the same for a shape in every process."""
    generator = torch.Generator().manual_seed(rows * 1_000_003 + cols)
    left = torch.randn(PROJECTIONS, rows, generator=generator)
    right = torch.randn(cols, PROJECTIONS, generator=generator)
    return left, right


def differs(trainer: torch.Tensor | list[float], engine: torch.Tensor | list[float]) -> float:
    """The largest projection difference relative to the tensor's scale (0: the same values in the same order;
    above :data:`TOLERANCE`: they differ). Both [PROJECTIONS + 1] from :func:`fingerprint` (or its list)."""
    trainer, engine = torch.as_tensor(trainer, dtype=torch.float64), torch.as_tensor(engine, dtype=torch.float64)
    scale = max(float(trainer[-1]), float(engine[-1]), 1e-30) ** 0.5
    projections = float((trainer[:-1] - engine[:-1]).abs().max()) / scale
    squares = abs(float(trainer[-1]) - float(engine[-1])) / scale**2
    return max(projections, squares)
