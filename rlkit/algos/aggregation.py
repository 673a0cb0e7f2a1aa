"""How per-token losses become one number: five modes, each written as per-token weights.

Writing each mode as weights w [B, T] with loss = sum(w * per_token) over masked-in tokens lets a
trainer split the batch over ranks and micro-batches freely: if the normalisers (token and
sequence counts) are the whole batch's, the partial sums add up to the same loss. Masked entries
are dropped (``torch.where``), not multiplied by a zero weight, so NaN or inf in padding never
reaches the loss.

- "token-mean": sum over all tokens / number of tokens. Long answers weigh more in total. DAPO
  (Yu et al. 2025) argues for it; verl's default.
- "seq-mean-token-mean": mean over each sequence's tokens, then over sequences. The original
  GRPO objective (Shao et al. 2024, DeepSeekMath); short answers' tokens weigh more, which
  Dr.GRPO shows biases towards long wrong answers. GSPO's paper uses it.
- "seq-mean-token-sum": each sequence's token sum, averaged over sequences (verl's mode of that
  name). The loss grows with the answers' length.
- "seq-mean-token-sum-norm": each sequence's token sum divided by a constant horizon (the
  generation budget, max_new_tokens), averaged over sequences. Dr.GRPO (Liu et al. 2025): no
  length bias. Until issue 17 rlkit called this "seq-mean-token-sum".
- "token-sum": the plain sum over all tokens (no normaliser; scales with the batch).

The same modes in the peers (rlkit = verl = TRL ``loss_type``):

- token-mean = verl "token-mean" = TRL "dapo" (global token count; TRL "bnpo" uses the local one).
- seq-mean-token-mean = verl "seq-mean-token-mean" = TRL "grpo" while every row has a response token. With
  empty rows (all of a response masked: truncation masking, a multi-turn row without model tokens) they differ:
  rlkit averages the per-sequence means over the sequences with at least one token, TRL's "grpo" over all rows
  (an empty row adds 0 and still counts), so TRL's loss is rlkit's times (non-empty rows / rows).
- seq-mean-token-sum = verl "seq-mean-token-sum" (TRL: none).
- seq-mean-token-sum-norm = TRL "dr_grpo" (sum / (B * max_completion_length)). verl's
  "seq-mean-token-sum-norm" divides each micro-batch's sum by the horizon without dividing by the
  number of sequences, so it is rlkit's value times the sequences per micro-batch (a constant scale).
- token-sum: verl and TRL have no such mode.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


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
        num_seqs: sequences with at least one token in the whole batch (the "seq-mean" modes); a
            0-dim tensor is fine too.
        horizon: the constant per-sequence normaliser of "seq-mean-token-sum-norm" (max_new_tokens).
    Returns:
        [b, T] float32 weights, 0 where masked. Combine them with :func:`weighted_sum`.
    """
    mask = (response_mask > 0).float()
    tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device).clamp(min=1)
    seqs = torch.as_tensor(num_seqs, dtype=torch.float32, device=mask.device).clamp(min=1)
    if mode == "token-mean":
        return mask / tokens
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / seqs
    if mode == "seq-mean-token-sum":
        return mask / seqs
    if mode == "seq-mean-token-sum-norm":
        return mask / (horizon * seqs)
    if mode == "token-sum":
        return mask
    raise ValueError(f'loss aggregation mode "{mode}": valid modes are {LOSS_AGG_MODES}')


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(weights * per_token) over the entries whose weight is not 0; the others are dropped, so a NaN or
    inf there changes neither the value nor the gradient of ``per_token`` (which is 0 there).
    Shapes: [b, T] each; returns a scalar."""
    return torch.where(weights != 0, per_token * weights, 0.0).sum()


def batch_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(masked-in tokens, sequences with at least one token) of a [B, T] mask."""
    mask = response_mask > 0
    return float(mask.sum()), float(mask.any(dim=1).sum())


def aggregate_loss(
    per_token: torch.Tensor, response_mask: torch.Tensor, mode: str, *, horizon: int | None = None
) -> torch.Tensor:
    """One scalar from a whole batch's [B, T] per-token loss; ``horizon`` defaults to T. Masked entries
    are dropped, so NaN or inf in padding gives a finite loss."""
    tokens, seqs = batch_counts(response_mask)
    weights = loss_weights(response_mask, mode, num_tokens=tokens, num_seqs=seqs, horizon=horizon or per_token.shape[1])
    return weighted_sum(per_token, weights)
