"""How per-token losses become one number: the three modes in use, as per-token weights.

Writing each mode as weights w [B, T] with loss = sum(w * per_token) lets a trainer
split the batch over ranks and micro-batches freely: if the normalisers (token and
sequence counts) are the whole batch's, the partial sums add up to the same loss.

- "token-mean": sum over all tokens / number of tokens. Long answers weigh more in
  total. DAPO (Yu et al. 2025) argues for it; verl's default.
- "seq-mean-token-mean": mean over each sequence's tokens, then over sequences. The
  original GRPO objective (Shao et al. 2024, DeepSeekMath); short answers' tokens
  weigh more, which Dr.GRPO shows biases towards long wrong answers.
- "seq-mean-token-sum": each sequence's token sum, divided by a constant horizon (the
  generation budget, max_new_tokens), averaged over sequences. Dr.GRPO (Liu et al.
  2025): no length bias.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def loss_weights(
    response_mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: torch.Tensor | float,
    num_seqs: torch.Tensor | float,
    horizon: int,
) -> torch.Tensor:
    """Per-token weights of ``mode``, given the normalisers of the whole batch.

    Args:
        response_mask: [b, T] the rows at hand (a slice of the whole batch is fine).
        mode: one of LOSS_AGG_MODES.
        num_tokens: masked-in tokens in the whole batch (used by "token-mean"); a 0-dim tensor on the
            mask's device keeps the count there (no host sync).
        num_seqs: sequences with at least one token in the whole batch (the "seq-mean" modes).
        horizon: the constant per-sequence normaliser of "seq-mean-token-sum".
    Returns:
        [b, T] float32 weights, 0 where masked.
    """
    mask = (response_mask > 0).float()
    tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device).clamp(min=1)
    seqs = torch.as_tensor(num_seqs, dtype=torch.float32, device=mask.device).clamp(min=1)
    if mode == "token-mean":
        return mask / tokens
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / seqs
    if mode == "seq-mean-token-sum":
        return mask / (horizon * seqs)
    raise ValueError(f'loss aggregation mode "{mode}": valid modes are {LOSS_AGG_MODES}')


def batch_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(masked-in tokens, sequences with at least one token) of a [B, T] mask."""
    mask = response_mask > 0
    return float(mask.sum()), float(mask.any(dim=1).sum())


def aggregate_loss(
    per_token: torch.Tensor, response_mask: torch.Tensor, mode: str, *, horizon: int | None = None
) -> torch.Tensor:
    """One scalar from a whole batch's [B, T] per-token loss; ``horizon`` defaults to T."""
    tokens, seqs = batch_counts(response_mask)
    weights = loss_weights(response_mask, mode, num_tokens=tokens, num_seqs=seqs, horizon=horizon or per_token.shape[1])
    return (per_token * weights).sum()
