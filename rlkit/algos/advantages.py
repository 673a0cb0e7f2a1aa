"""Advantage estimators on per-sequence rewards."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-relative advantages.

    Args:
        rewards: [B] one scalar reward per completion, where completions
            ``g*group_size .. (g+1)*group_size - 1`` answer the same prompt.
        group_size: completions per prompt (G); B must be a multiple of it.
        scale: divide by the group's standard deviation (unbiased, as in the
            DeepSeekMath paper); False gives Dr.GRPO's mean-centred form.
        eps: added to the std so that a group of equal rewards gives 0.

    Returns:
        [B] advantages, float32.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
