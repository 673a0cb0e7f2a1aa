"""Policy and value losses and the entropy bonus, per token; aggregation is in :mod:`rlkit.algos.aggregation`."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 for an empty mask). Shapes: [B, T] each; returns a scalar,
    or with ``dim`` the means along it (``dim=1``: [B], one per row)."""
    keep = mask > 0
    kept = torch.where(keep, values, 0.0)
    if dim is None:
        return kept.sum() / keep.sum().clamp(min=1)
    return kept.sum(dim=dim) / keep.sum(dim=dim).clamp(min=1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017), negated to be minimised, with its two common variants.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy.
        old_logprobs: [B, T] the same under the policy that sampled them.
        advantages: [B] per-sequence or [B, T] per-token advantages.
        clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_high].
        clip_high: upper clip; None uses clip_eps. A larger value ("clip-higher", DAPO, Yu et al.
            2025, e.g. 0.28) lets unlikely tokens with positive advantage grow, against entropy collapse.
        dual_clip: dual-clip constant c > 1 (Ye et al. 2020, e.g. 3.0): for negative advantages the
            loss is capped at -c * A, so a huge ratio cannot blow the update up. None disables it.

    Returns:
        loss: [B, T] per-token loss, max(-A * r, -A * clip(r)) (then min(., -c * A) where A < 0).
        clipped: [B, T] 1.0 where a clip zeroed the token's gradient, else 0.0.
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    high = clip_eps if clip_high is None else clip_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped.float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss, 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -clip, clip).

    Args:
        values: [B, T] current critic values; old_values: [B, T] the same at rollout time.
        returns: [B, T] targets (GAE returns).
        clip: how far a value may move from old_values before its loss stops pulling; None: plain 0.5 * (V - R)^2.

    Returns:
        loss: [B, T] per token.
        clipped: [B, T] 1.0 where the clipped branch was larger (the token's gradient is zero), else 0.0.
    """
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    moved = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (moved - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim. Shapes: [B, T, V] -> [B, T] float32.

    Divide the logits by the sampling temperature first to get the entropy of the sampling distribution.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over masked-in tokens: 1 is a perfect critic, <= 0 a useless one.

    Shapes: [B, T] each. Returns nan when the returns do not vary.
    """
    m = mask > 0
    ret, val = returns[m].double(), values[m].double()
    var = ret.var(unbiased=False)
    return float("nan") if var == 0 else float(1 - (ret - val).var(unbiased=False) / var)
