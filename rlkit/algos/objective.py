"""The actor's and the critic's objectives for one micro-batch: per-token math to one loss and named metrics.

Both take aggregation ``weights`` [b, T] from :func:`rlkit.algos.loss_weights` (normalised by the
whole mini-batch over all ranks), so ``loss = sum(weights * per_token)`` of every micro-batch on
every rank adds up to the loss of the unsplit batch. Metrics are :class:`rlkit.algos.Mean` sums,
named where they are made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkit.algos.aggregation import weighted_sum
from rlkit.algos.kl import kl_estimate
from rlkit.algos.losses import POLICY_LOSSES, clipped_value_loss
from rlkit.algos.metrics import Mean, token_mean

PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``fn(new_logprobs, old_logprobs, advantages, response_mask) -> (loss, clipped)``, all [B, T]:
the per-token loss to minimise (rlkit aggregates it with ``loss_agg``) and a 0/1 float marking
tokens whose gradient a clip removed (for actor/clipfrac; zeros if there is no clip)."""


@dataclass(frozen=True, kw_only=True)
class PolicyObjective:
    """What the actor minimises per token: policy loss + ``kl_coef`` x KL to the reference - ``entropy_coef`` x entropy.

    ``policy_loss`` names the loss in :data:`rlkit.algos.POLICY_LOSSES` ("ppo_clip", "gspo");
    ``policy_loss_fn`` replaces it (see :data:`PolicyLossFn`). ``kl_coef`` is the KL's weight in
    the LOSS (0 when the KL is a reward penalty instead).
    """

    policy_loss: str = "ppo_clip"
    clip_eps: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float = 20.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = 10.0
    entropy_coef: float = 0.0
    policy_loss_fn: PolicyLossFn | None = None


def policy_objective(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    weights: torch.Tensor,
    objective: PolicyObjective,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Mean]]:
    """One micro-batch's share of the actor's loss, and its metrics.

    Args:
        new_logprobs: [b, T] log-probs of the sampled tokens under the policy being trained (with grad).
        old_logprobs: [b, T] the same under the policy that sampled them (PPO's old policy).
        advantages: [b, T] per token (or [b] per sequence).
        response_mask: [b, T] 1 on generated tokens.
        weights: [b, T] aggregation weights (see rlkit.algos.loss_weights).
        ref_logprobs: [b, T] under the frozen reference; needed when ``objective.kl_coef > 0``.
        entropy: [b, T] of the sampling distribution (with grad when ``objective.entropy_coef > 0``).
    Returns:
        ``sum(weights * per_token_loss)`` and the metrics actor/clipfrac, actor/approx_kl (k3 of the
        old policy from the new), actor/kl_loss and actor/entropy (token means).
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1).expand_as(new_logprobs)
    per_token, clipped = _policy_loss(new_logprobs, old_logprobs, advantages, response_mask, objective)
    kl = torch.zeros_like(per_token)
    if objective.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference's log-probs)")
        kl = kl_estimate(
            torch.where(response_mask > 0, new_logprobs, 0.0),
            torch.where(response_mask > 0, ref_logprobs, 0.0),  # padding may hold NaN: keep it out of the graph
            objective.kl_estimator,
            clamp=objective.kl_clamp,
            log_ratio_clamp=objective.log_ratio_clamp,
        )
        per_token = per_token + objective.kl_coef * kl
    if objective.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the sampling distribution")
        per_token = per_token - objective.entropy_coef * entropy
    loss = weighted_sum(per_token, weights)
    approx_kl = kl_estimate(
        old_logprobs, new_logprobs.detach(), "k3", clamp=None, log_ratio_clamp=objective.log_ratio_clamp
    )
    metrics = {
        "actor/clipfrac": token_mean(clipped, response_mask),
        "actor/approx_kl": token_mean(approx_kl, response_mask),
        "actor/kl_loss": token_mean(kl, response_mask),
    }
    if entropy is not None:
        metrics["actor/entropy"] = token_mean(entropy, response_mask)
    return loss, metrics


def _policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    objective: PolicyObjective,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's policy_loss_fn (shape-checked) or the named loss with the objective's clip settings. [b, T] each."""
    fn = objective.policy_loss_fn
    if fn is None:
        return POLICY_LOSSES[objective.policy_loss](
            new_logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_eps=objective.clip_eps,
            clip_high=objective.clip_high,
            dual_clip=objective.dual_clip,
            log_ratio_clamp=objective.log_ratio_clamp,
        )
    out = fn(new_logprobs, old_logprobs, advantages, response_mask)
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and all(isinstance(t, torch.Tensor) and t.shape == new_logprobs.shape for t in out)
    ):
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"policy_loss_fn {name!r} must return (loss, clipped), two tensors of shape "
            f"{list(new_logprobs.shape)} (per token); got {_describe(out)}"
        )
    return out


def value_objective(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, Mean]]:
    """One micro-batch's share of the critic's clipped value loss ([b, T] each), and critic/value_clipfrac."""
    per_token, clipped = clipped_value_loss(values, old_values, returns, clip)
    loss = weighted_sum(per_token, weights)
    return loss, {"critic/value_clipfrac": token_mean(clipped, response_mask)}


def _describe(out: object) -> str:
    if isinstance(out, tuple):
        return (
            "(" + ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in out) + ")"
        )
    return type(out).__name__
