"""One optimizer step from micro-batches on every rank, whose loss equals the whole mini-batch's.

Each token's weight comes from :func:`rlkit.algos.loss_weights` with the token and
sequence counts of the whole mini-batch (summed over ranks), so the micro-batch
losses of all ranks add up to the loss of the unsplit batch. FSDP averages
gradients over ranks, so each rank's backward is scaled by the world size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rlkit.algos import loss_weights
from rlkit.fsdp import clip_grad_norm

MicroLoss = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``fn(micro, weights [b, T]) -> (loss scalar = sum(weights * per_token), stats [K] float64 sums)``."""


def global_loss_weights(response_mask: torch.Tensor, mode: str, horizon: int) -> torch.Tensor:
    """[n, T] weights for this rank's rows, normalised by the counts over all ranks (a collective)."""
    mask = response_mask > 0
    counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)
    dist.all_reduce(counts)
    tokens, seqs = counts.tolist()
    return loss_weights(response_mask, mode, num_tokens=tokens, num_seqs=seqs, horizon=horizon)


def accumulated_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    mini: dict[str, torch.Tensor],
    *,
    micro_loss: MicroLoss,
    num_stats: int,
    micro_batch_size: int,
    loss_agg: str,
    horizon: int,
    max_grad_norm: float,
    before_clip: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, float]:
    """Zero grads, accumulate ``micro_loss`` over micro-batches of ``mini``, clip, step optimizer and schedule.

    Args:
        mini: this rank's rows, each tensor [n, ...]; needs response_mask [n, T].
        before_clip: called once gradients are accumulated, before clipping (diagnostics hook).
    Returns:
        [num_stats + 1] float64 sums on this rank (micro_loss's stats, then 1.0 for the step count)
        and the true global gradient norm.
    """
    world = dist.get_world_size()
    weights = global_loss_weights(mini["response_mask"], loss_agg, horizon)
    sums = torch.zeros(num_stats + 1, dtype=torch.float64, device=weights.device)
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, weights.shape[0], micro_batch_size):
        micro = {k: v[i : i + micro_batch_size] for k, v in mini.items()}
        loss, stats = micro_loss(micro, weights[i : i + micro_batch_size])
        (loss * world).backward()
        sums[:num_stats] += stats
    sums[num_stats] = 1.0
    if before_clip is not None:
        before_clip()
    norm = clip_grad_norm(model, max_grad_norm)
    optimizer.step()
    scheduler.step()
    return sums, norm
