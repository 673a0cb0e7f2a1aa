"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman 2020), clamped for safety."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    *,
    clamp: float | None = 10.0,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """KL estimate per token for tokens sampled from the policy.

    Args:
        logprobs: [B, T] policy log-probs of the sampled tokens.
        ref_logprobs: [B, T] reference log-probs of the same tokens.
        estimator: "k1" (log-ratio r = logp - ref, unbiased, can be negative), "k2" (r^2 / 2) or
            "k3" (exp(-r) - 1 + r, unbiased and non-negative; GRPO's choice).
        clamp: the estimate is clamped to [-clamp, clamp] (k2 and k3 are >= 0, so only the upper bound
            acts on them) and its gradient is 0 where clamped, as verl caps k3 at 10. k3 reaches 10 once
            the reference gives a token ~2.6 nats more than the policy (and grows like e^-r beyond).
            None: no clamp.
        log_ratio_clamp: k3's exponent -r is clamped to [-log_ratio_clamp, log_ratio_clamp] first (gradient
            0 beyond), so a log-ratio of +-1000 gives neither inf nor NaN, with or without ``clamp``.

    Returns:
        [B, T] estimates (unmasked: pass masked log-probs, or drop padding with torch.where, when padding
        may hold NaN or inf).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        r = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        kl = torch.expm1(-r) + r
    else:
        raise ValueError(f'estimator="{estimator}": valid estimators are {KL_ESTIMATORS}')
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_reward_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k3",
    clamp: float | None = 10.0,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """Subtract ``coef`` times the per-token KL estimate from the token rewards (the KL as a reward penalty,
    as in InstructGPT-style PPO, which used k1), before advantages are estimated; padding is left as it was.
    ``estimator``, ``clamp`` and ``log_ratio_clamp`` as in :func:`kl_estimate`. Shapes: [B, T] each; returns [B, T]."""
    mask = response_mask > 0
    kl = kl_estimate(
        torch.where(mask, logprobs, 0.0),
        torch.where(mask, ref_logprobs, 0.0),
        estimator,
        clamp=clamp,
        log_ratio_clamp=log_ratio_clamp,
    )
    return torch.where(mask, token_rewards - coef * kl, token_rewards)
