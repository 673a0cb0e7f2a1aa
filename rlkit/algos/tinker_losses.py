"""Tinker's built-in losses (``forward_backward(data, loss_fn)``), per token, as Tinker's docs define them.

Every loss is a SUM over tokens (and, summed by the caller, over the data): no normalisation by counts. The inputs
are [B, N] rows aligned with the model input (position i predicts ``target_tokens[i]``); ``mask`` is 1 on real
positions and 0 on the padding that makes rows of different lengths one tensor. The policy losses reuse rlkit's
(:func:`~rlkit.algos.losses.clipped_policy_loss`, :func:`~rlkit.algos.losses.cispo_policy_loss`); Tinker's absolute
thresholds ``clip_low_threshold``/``clip_high_threshold`` are rlkit's ``1 - clip_eps`` and ``1 + clip_high``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlkit.algos.losses import cispo_policy_loss, clipped_policy_loss

TINKER_LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
"""The ``loss_fn_inputs`` each supported loss reads (Tinker's names)."""

CLIP_THRESHOLDS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
"""``loss_fn_config`` keys of ppo and cispo and their defaults (Tinker's eps_low = eps_high = 0.2)."""

LOG_RATIO_CLAMP = 50.0
"""The log-ratio is clamped to +-this before exp (rlkit's guard against overflow; far beyond any real ratio)."""


def tinker_token_loss(
    loss_fn: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    config: Mapping[str, float] | None = None,
) -> torch.Tensor:
    """[B, N] per-token loss of ``loss_fn``; its sum is Tinker's loss. 0 where ``mask`` is 0.

    Args:
        loss_fn: a key of :data:`TINKER_LOSS_INPUTS`.
        target_logprobs: [B, N] the learner's log-probs of ``target_tokens`` (with grad).
        inputs: [B, N] float tensors by Tinker's names: ``weights`` (cross_entropy); ``logprobs`` (the sampler's) and
            ``advantages`` (the policy losses).
        mask: [B, N] 1 on real positions.
        config: ppo/cispo's ``clip_low_threshold``, ``clip_high_threshold`` (defaults :data:`CLIP_THRESHOLDS`).
    """
    keep = mask > 0
    if loss_fn == "cross_entropy":
        return torch.where(keep, -inputs["weights"] * target_logprobs, 0.0)
    sampling, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        log_ratio = torch.where(keep, target_logprobs - sampling, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.where(keep, -torch.exp(log_ratio) * advantages, 0.0)
    thresholds = {**CLIP_THRESHOLDS, **(config or {})}
    clip_eps, clip_high = 1.0 - thresholds["clip_low_threshold"], thresholds["clip_high_threshold"] - 1.0
    if loss_fn == "ppo":
        loss, _ = clipped_policy_loss(target_logprobs, sampling, advantages, clip_eps, clip_high=clip_high,
                                      log_ratio_clamp=LOG_RATIO_CLAMP, response_mask=mask)  # fmt: skip
        return loss
    if loss_fn == "cispo":
        loss, _ = cispo_policy_loss(target_logprobs, sampling, advantages, mask, clip_eps=clip_eps,
                                    clip_high=clip_high, log_ratio_clamp=LOG_RATIO_CLAMP)  # fmt: skip
        return loss
    raise ValueError(f"loss_fn={loss_fn!r}: rlkit supports {', '.join(TINKER_LOSS_INPUTS)}")
