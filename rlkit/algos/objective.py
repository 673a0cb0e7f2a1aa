"""The actor's and the critic's objectives for one micro-batch: per-token math to one loss and named metrics.

Both take aggregation ``weights`` [b, T] from :func:`rlkit.algos.loss_weights` (normalised by the
whole mini-batch over all ranks), so ``loss = sum(weights * per_token)`` of every micro-batch on
every rank adds up to the loss of the unsplit batch. Metrics are :class:`rlkit.algos.Mean` sums (and
extremes), named where they are made. Given the engine's log-probs, the actor's objective also measures the
training-inference mismatch and, with a :class:`~rlkit.algos.correction.Correction`, corrects for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkit.algos.aggregation import weighted_sum
from rlkit.algos.correction import (
    Correction,
    correction_metrics,
    correction_weights,
    engine_log_ratio,
    mismatch_metrics,
)
from rlkit.algos.kl import kl_estimate
from rlkit.algos.losses import POLICY_LOSSES, PolicyLossSettings, clipped_value_loss
from rlkit.algos.metrics import Mean, Metric, token_mean

PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``fn(new_logprobs, old_logprobs, advantages, response_mask) -> (loss, clipped)``, all [B, T]:
the per-token loss to minimise (rlkit aggregates it with ``loss_agg``) and a 0/1 float marking
tokens whose gradient a clip removed (for actor/clipfrac; zeros if there is no clip)."""


@dataclass(frozen=True, kw_only=True)
class PolicyObjective:
    """What the actor minimises per token: w x policy loss + ``kl_coef`` x KL to the reference - ``entropy_coef`` x
    entropy, with w the rollout ``correction``'s weights (1 without one).

    ``policy_loss`` names the loss in :data:`rlkit.algos.POLICY_LOSSES` ("ppo_clip", "gspo", "cispo", "sapo"),
    which reads its settings from ``loss``; ``policy_loss_fn`` replaces it (see :data:`PolicyLossFn`).
    ``kl_coef`` is the KL's weight in the LOSS (0 when the KL is a reward penalty instead).
    """

    policy_loss: str = "ppo_clip"
    loss: PolicyLossSettings = PolicyLossSettings()
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = 10.0
    entropy_coef: float = 0.0
    policy_loss_fn: PolicyLossFn | None = None
    correction: Correction | None = None
    """None or a disabled correction: the engine's log-probs (when given) are measured, the loss is unchanged."""


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
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """One micro-batch's share of the actor's loss, and its metrics.

    Args:
        new_logprobs: [b, T] log-probs of the sampled tokens under the policy being trained (with grad).
        old_logprobs: [b, T] the same under the trainer before the update (PPO's old policy).
        advantages: [b, T] per token (or [b] per sequence).
        response_mask: [b, T] 1 on generated tokens.
        weights: [b, T] aggregation weights (see rlkit.algos.loss_weights).
        ref_logprobs: [b, T] under the frozen reference; needed when ``objective.kl_coef > 0``.
        entropy: [b, T] of the sampling distribution (with grad when ``objective.entropy_coef > 0``).
        rollout_logprobs: [b, T] under the rollout engine that sampled (NaN on rows it returned none for);
            needed by an enabled ``objective.correction``.
    Returns:
        ``sum(weights * per_token_loss)`` and the metrics actor/clipfrac, actor/approx_kl (k3 of the
        old policy from the new), actor/kl_loss and actor/entropy (token means); with ``rollout_logprobs``
        the mismatch/... metrics, and with a correction the rollout_correction/... ones (rlkit.algos.correction).
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1).expand_as(new_logprobs)
    behaviour, is_weights, gap_metrics = _engine_side(old_logprobs, rollout_logprobs, response_mask, objective)
    per_token, clipped = _policy_loss(new_logprobs, behaviour, advantages, response_mask, objective)
    if is_weights is not None:  # the weights multiply the policy loss only (as verl's and TRL's)
        per_token = torch.where(is_weights > 0, per_token * is_weights, 0.0)
    kl = _reference_kl(new_logprobs, ref_logprobs, response_mask, objective)
    if objective.kl_coef > 0:
        per_token = per_token + objective.kl_coef * kl
    if objective.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the sampling distribution")
        per_token = per_token - objective.entropy_coef * entropy
    loss = weighted_sum(per_token, weights)
    approx_kl = kl_estimate(
        old_logprobs, new_logprobs.detach(), "k3", clamp=None, log_ratio_clamp=objective.loss.log_ratio_clamp
    )
    metrics: dict[str, Metric] = {
        "actor/clipfrac": token_mean(clipped, response_mask),
        "actor/approx_kl": token_mean(approx_kl, response_mask),
        "actor/kl_loss": token_mean(kl, response_mask),
    }
    if entropy is not None:
        metrics["actor/entropy"] = token_mean(entropy, response_mask)
    return loss, {**metrics, **gap_metrics}


def _reference_kl(
    new_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    objective: PolicyObjective,
) -> torch.Tensor:
    """[b, T] the KL estimate to the reference when the loss has a KL term, else zeros."""
    if objective.kl_coef <= 0:
        return torch.zeros_like(new_logprobs)
    if ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference's log-probs)")
    return kl_estimate(
        torch.where(response_mask > 0, new_logprobs, 0.0),
        torch.where(response_mask > 0, ref_logprobs, 0.0),  # padding may hold NaN: keep it out of the graph
        objective.kl_estimator,
        clamp=objective.kl_clamp,
        log_ratio_clamp=objective.loss.log_ratio_clamp,
    )


def _engine_side(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    objective: PolicyObjective,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Metric]]:
    """The log-probs the loss's ratio is taken against (the trainer's old ones; the engine's in bypass mode), the
    correction's [b, T] weights (None without a correction) and the mismatch (and correction) metrics."""
    correction = objective.correction if objective.correction is not None and objective.correction.enabled else None
    if rollout_logprobs is None:
        if correction is not None:
            raise ValueError("a rollout correction needs rollout_logprobs (the engine's log-probs of every row)")
        return old_logprobs, None, {}
    clamp = objective.loss.log_ratio_clamp
    delta, checked = engine_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    metrics = mismatch_metrics(delta, checked, log_ratio_clamp=clamp)
    if correction is None:
        return old_logprobs, None, metrics
    result = correction_weights(delta, checked, correction, log_ratio_clamp=clamp)
    behaviour = torch.where(checked, rollout_logprobs, old_logprobs) if correction.bypass else old_logprobs
    return behaviour, result.weights, {**metrics, **correction_metrics(result, checked)}


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
            new_logprobs, old_logprobs, advantages, response_mask, objective.loss
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
