"""Policy losses, per token; aggregation is the caller's choice."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1. Shapes: [B, T] each; returns a scalar (0 for an empty mask)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017), negated to be minimised.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy.
        old_logprobs: [B, T] the same under the policy that sampled them.
        advantages: [B] per-sequence or [B, T] per-token advantages.
        clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].

    Returns:
        loss: [B, T] per-token loss, max(-A * r, -A * clip(r)).
        clipped: [B, T] 1.0 where the clipped branch was taken, else 0.0.
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()
