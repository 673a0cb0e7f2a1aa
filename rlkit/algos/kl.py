"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman 2020)."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """KL estimate per token for tokens sampled from the policy.

    Args:
        logprobs: [B, T] policy log-probs of the sampled tokens.
        ref_logprobs: [B, T] reference log-probs of the same tokens.
        estimator: "k1" (log-ratio, unbiased, can be negative), "k2" (half the
            squared log-ratio) or "k3" (exp(-r) - 1 + r with r = logp - ref,
            unbiased and non-negative; GRPO's choice).

    Returns:
        [B, T] estimates (unmasked).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f'estimator="{estimator}": valid estimators are {KL_ESTIMATORS}')


def kl_reward_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Subtract ``coef`` times the per-token KL estimate from the token rewards (the KL as a reward penalty,
    as in InstructGPT-style PPO), before advantages are estimated. Shapes: [B, T] each; returns [B, T]."""
    return token_rewards - coef * kl_estimate(logprobs, ref_logprobs, estimator) * (response_mask > 0)
