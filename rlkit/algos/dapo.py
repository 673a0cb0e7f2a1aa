"""DAPO's batch-shaping pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

Pure functions; the trainer applies them:

- :func:`overlong_penalty`: soft overlong punishment, added to the rewards before advantages.
- :func:`mask_truncated`: completions cut at max_new_tokens leave the loss (their reward still counts
  in their group's statistics, as in TRL's ``mask_truncated_completions``), and so do trajectories cut at
  their token budget.
- :func:`informative_groups`: dynamic sampling's filter; groups whose rewards are all equal give every
  sample a zero group-relative advantage (no gradient), so the trainer drops them and samples again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlkit.algos.advantages import group_index


def overlong_penalty(lengths: torch.Tensor, *, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13): 0 for completions of up to ``max_new_tokens - buffer`` tokens,
    then falling linearly to ``-penalty`` at ``max_new_tokens`` (and staying there beyond).

    Args:
        lengths: [B] generated tokens per completion (``response_mask.sum(1)``, end-of-text included).
        max_new_tokens: the generation budget (DAPO's L_max).
        buffer: the punishment interval (DAPO's L_cache), 1 <= buffer <= max_new_tokens.
        penalty: the penalty at full length (1.0 in the paper, verl's ``penalty_factor``).
    Returns:
        [B] float32 penalties in [-penalty, 0], to add to the rewards.
    """
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer={buffer}: must be in [1, max_new_tokens={max_new_tokens}]")
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * (excess / buffer).clamp(max=1)


TRUNCATED = ("length", "budget")
"""The finish reasons of a truncated sample: a completion (or a trajectory's model turn) cut at its token limit,
and a trajectory whose next observation did not fit its token budget."""


def mask_truncated(response_mask: torch.Tensor, finish_reason: Sequence[str]) -> torch.Tensor:
    """The response mask with every truncated sample (a finish reason in :data:`TRUNCATED`) zeroed, so it leaves
    the loss.

    Args:
        response_mask: [B, T]; finish_reason: B values, ``Batch.finish_reason``.
    Returns:
        [B, T], response_mask's dtype.
    """
    return mask_finished(response_mask, finish_reason, TRUNCATED)


def mask_finished(response_mask: torch.Tensor, finish_reason: Sequence[str], reasons: Sequence[str]) -> torch.Tensor:
    """The response mask with every row whose finish reason is one of ``reasons`` zeroed.

    Args:
        response_mask: [B, T]; finish_reason: B values, ``Batch.finish_reason``.
    Returns:
        [B, T], response_mask's dtype.
    """
    if len(finish_reason) != response_mask.shape[0]:
        raise ValueError(f"finish_reason has {len(finish_reason)} values for {response_mask.shape[0]} completions")
    kept = torch.tensor([reason not in reasons for reason in finish_reason], device=response_mask.device)
    return torch.where(kept.unsqueeze(1), response_mask, torch.zeros_like(response_mask))


def informative_groups(rewards: torch.Tensor, group: torch.Tensor | int) -> torch.Tensor:
    """Dynamic sampling's filter (DAPO, eq. 11): True for the rows of groups whose rewards are not all equal.

    Equality is exact, as verl's std == 0 test; a group of one sample is never informative.

    Args:
        rewards: [B]; group: [B] int64 group index, or an int G for contiguous blocks of G rows.
    Returns:
        [B] bool.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D ([B] one per completion), got {tuple(rewards.shape)}")
    _, inverse = torch.unique(group_index(group, rewards.numel()).to(rewards.device), return_inverse=True)
    values = rewards.float()
    size = int(inverse.max()) + 1 if inverse.numel() else 0
    high = torch.full((size,), -torch.inf, device=values.device).scatter_reduce(0, inverse, values, "amax")
    low = torch.full((size,), torch.inf, device=values.device).scatter_reduce(0, inverse, values, "amin")
    return (high != low)[inverse]
