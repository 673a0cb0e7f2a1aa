"""Training-inference mismatch: the engine-vs-trainer log-ratio, the importance weights correcting it, its metrics.

The rollout engine (the behaviour policy that sampled) and the trainer give the same tokens different
probabilities (kernels, bf16, sampling settings, stale weights), so an "on-policy" update is slightly off-policy.
Notation, all [B, T] with m = the response mask:

- l_e = ``rollout_logprobs``, the engine's log-probs of the sampled tokens;
- l_o = ``old_logprobs``, the trainer's of the same tokens before the update (PPO's proximal policy);
- delta = l_o - l_e and rho = exp(delta), the importance ratio trainer / engine (detached).

A correction is a weight per token, applied to the policy loss (decoupled PPO: L_t = w_t * PPO_t(r_t) with
r_t = exp(l - l_o)), from two independent choices (as verl's ``rollout_is`` and ``rollout_rs``):

- ``weight`` (truncated importance sampling): "token" w_t = clip(rho_t, floor, cap) (TIS); "sequence" the
  product of the sequence's token ratios, exp(sum_t m delta), truncated, on each of its tokens (the unbiased
  sequence ratio: it grows with length); "geometric" its geometric mean exp(sum_t m delta / sum_t m)
  (length-invariant: a filter, not an unbiased weight; GSPO's object).
- ``mask`` (rejection, MIS / ICEPOP): tokens ("token") or whole sequences ("sequence", "geometric") whose ratio at
  that level leaves [low, high] get weight 0. rlkit zeroes the weight and keeps the loss's normalisers (TRL,
  OpenRLHF, NeMo-RL): rejected tokens still count in the token and sequence counts, so the loss is the IS estimate
  with weight 0 there, and the normalisers stay the whole batch's, fixed before the first micro-batch. (verl's
  rejection shrinks the loss mask instead, renormalising over the kept tokens.) The band is on rho itself
  (verl's ``*_k1`` rejection tests -ln rho, so its asymmetric bands act on 1 / rho).

``bypass`` is verl's bypass mode: the engine's log-probs stand for l_o in the ratio (r_t = exp(l - l_e)), and
no weight is added (it would count the gap twice); a mask still applies.

Numerics (the peers' pitfalls): fp32 throughout; sums in log space; every log-ratio clamped to +-20 before exp;
padding and non-finite log-probs (engines can emit NaN or -inf) are dropped with ``torch.where``, never
multiplied by 0; a token without a finite engine log-prob gets weight 0; weights are detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlkit.algos.metrics import Mean, Metric, token_max, token_mean, token_min

CORRECTION_LEVELS = ("none", "token", "sequence", "geometric")
"""Values of :attr:`Correction.weight` and :attr:`Correction.mask`."""


@dataclass(frozen=True, kw_only=True)
class Correction:
    """A rollout correction (see the module doc; the config's ``[rollout_correction]`` documents each setting)."""

    weight: str = "none"
    """IS weight level: one of :data:`CORRECTION_LEVELS`."""
    weight_cap: float | None = 2.0
    """Upper truncation of the weight (None: none beyond the +-20 log clamp)."""
    weight_floor: float = 0.0
    """Lower truncation of the weight (0: none)."""
    mask: str = "none"
    """Rejection level: one of :data:`CORRECTION_LEVELS`."""
    mask_low: float = 0.5
    """Ratios below this are rejected (0: no lower bound)."""
    mask_high: float = 2.0
    """Ratios above this are rejected."""
    bypass: bool = False
    """The engine's log-probs stand for the old policy's in the loss's ratio."""

    @property
    def enabled(self) -> bool:
        """Whether this correction changes the loss at all."""
        return self.weight != "none" or self.mask != "none" or self.bypass


@dataclass(frozen=True)
class CorrectionWeights:
    """What a :class:`Correction` makes of one batch, all [B, T]."""

    weights: torch.Tensor
    """float32, detached: the policy loss's per-token multiplier (0 where masked out, rejected or unchecked)."""
    truncated: torch.Tensor
    """bool: checked tokens whose weight the cap or floor changed."""
    rejected: torch.Tensor
    """bool: checked tokens the mask rejected (weight 0)."""


def engine_log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """delta = l_o - l_e in fp32, detached, 0 where not checked, and ``checked``: the response tokens whose two
    log-probs are both finite (rows the engine returned none for are NaN). Shapes: [B, T] each."""
    old, engine = old_logprobs.detach().float(), rollout_logprobs.detach().float()
    checked = (response_mask > 0) & torch.isfinite(old) & torch.isfinite(engine)
    return torch.where(checked, old - engine, 0.0), checked


def level_log_ratio(delta: torch.Tensor, checked: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T] the log of the ratio at ``level`` on every token: delta itself ("token"), the sequence's sum
    ("sequence": log of the product) or mean ("geometric"), over its checked tokens."""
    if level == "token":
        return delta
    total = torch.where(checked, delta, 0.0).sum(dim=1, keepdim=True)
    if level == "sequence":
        return total.expand_as(delta)
    if level == "geometric":
        return (total / checked.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(delta)
    raise ValueError(f'level "{level}": use one of {CORRECTION_LEVELS[1:]}')


def truncated_weights(
    delta: torch.Tensor,
    checked: torch.Tensor,
    level: str,
    *,
    cap: float | None,
    floor: float = 0.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS weights w = clip(rho_level, floor, cap) on checked tokens, 0 elsewhere, and where the
    truncation acted (compared in log space, so a ratio of exactly ``cap`` is not counted). [B, T] each."""
    log_ratio = level_log_ratio(delta, checked, level).clamp(-log_ratio_clamp, log_ratio_clamp)
    high = math.inf if cap is None else cap
    truncated = checked & ((log_ratio > _log(high)) | (log_ratio < _log(floor)))
    weights = torch.exp(log_ratio).clamp(min=floor, max=high)
    return torch.where(checked, weights, 0.0), truncated


def rejection_keep(delta: torch.Tensor, checked: torch.Tensor, level: str, *, low: float, high: float) -> torch.Tensor:
    """[B, T] bool: checked tokens whose ratio at ``level`` lies in [low, high] (in log space)."""
    log_ratio = level_log_ratio(delta, checked, level)
    return checked & (log_ratio >= _log(low)) & (log_ratio <= _log(high))


def correction_weights(
    delta: torch.Tensor, checked: torch.Tensor, correction: Correction, *, log_ratio_clamp: float = 20.0
) -> CorrectionWeights:
    """The per-token weights of ``correction`` for delta and checked ([B, T], from :func:`engine_log_ratio`)."""
    if correction.weight == "none" or correction.bypass:
        weights, truncated = checked.float(), torch.zeros_like(checked)
    else:
        weights, truncated = truncated_weights(
            delta, checked, correction.weight, cap=correction.weight_cap, floor=correction.weight_floor,
            log_ratio_clamp=log_ratio_clamp,
        )  # fmt: skip
    keep = checked
    if correction.mask != "none":
        keep = rejection_keep(delta, checked, correction.mask, low=correction.mask_low, high=correction.mask_high)
    return CorrectionWeights(torch.where(keep, weights, 0.0), truncated, checked & ~keep)


def mismatch_metrics(delta: torch.Tensor, checked: torch.Tensor, *, log_ratio_clamp: float = 20.0) -> dict[str, Metric]:
    """The engine-vs-trainer gap per checked token ([B, T] each), as step metrics (see the README's table):
    mismatch/kl_k1 (mean l_e - l_o, the k1 estimate of KL(engine || trainer), can be < 0), mismatch/kl_k3
    (mean rho - 1 - delta, >= 0), mismatch/chi2 (mean rho^2 - 1), mismatch/abs_delta/{mean,max} and the raw
    ratio mismatch/ratio/{mean,max,min}; k3 and ``|delta|`` also per rank. delta is clamped to +-``log_ratio_clamp``
    before every exp (k3, chi2, the ratio); k1 and ``|delta|`` are the raw gap."""
    delta = delta.double()  # k3 and chi2 of gaps near 1e-6 cancel to noise in fp32
    clamped = delta.clamp(-log_ratio_clamp, log_ratio_clamp)  # what enters exp: k3, chi2 and the ratio
    ratio = torch.exp(clamped)
    gap = delta.abs()
    return {
        "mismatch/kl_k1": token_mean(-delta, checked),
        "mismatch/kl_k3": token_mean(torch.expm1(clamped) - clamped, checked, per_rank=True),
        "mismatch/chi2": token_mean(torch.expm1(2 * clamped), checked),
        "mismatch/abs_delta/mean": token_mean(gap, checked, per_rank=True),
        "mismatch/abs_delta/max": token_max(gap, checked, per_rank=True),
        "mismatch/ratio/mean": token_mean(ratio, checked),
        "mismatch/ratio/max": token_max(ratio, checked),
        "mismatch/ratio/min": token_min(ratio, checked),
    }


def correction_metrics(result: CorrectionWeights, checked: torch.Tensor) -> dict[str, Metric]:
    """What a correction did to the checked tokens ([B, T]): rollout_correction/weight/{mean,max,min} (after
    truncation and rejection), the shares truncated and masked (tokens), and masked_seq_frac (sequences with a
    rejected token)."""
    rows = checked.any(dim=1)
    return {
        "rollout_correction/weight/mean": token_mean(result.weights, checked),
        "rollout_correction/weight/max": token_max(result.weights, checked),
        "rollout_correction/weight/min": token_min(result.weights, checked),
        "rollout_correction/truncated_frac": token_mean(result.truncated.float(), checked),
        "rollout_correction/masked_frac": token_mean(result.rejected.float(), checked),
        "rollout_correction/masked_seq_frac": Mean(result.rejected.any(dim=1).sum(), rows.sum()),
    }


def mismatch_summary(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """One batch's gap statistics as plain numbers: tokens checked, k1, k3, chi2, the mean of ``exp|delta|``
    (NeMo-RL's token_mult_prob_error), ``|delta|`` mean and max, the raw ratio's mean, min and max, and its effective
    sample size 1 / mean((rho / mean rho)^2) in (0, 1] (1: the engine samples the trainer's distribution)."""
    delta, checked = engine_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    d = delta[checked].double()
    if d.numel() == 0:
        return {"tokens": 0.0}
    clamped = d.clamp(-20.0, 20.0)  # what enters exp (k1 and |delta| stay raw)
    ratio = torch.exp(clamped)
    return {
        "tokens": float(d.numel()),
        "kl_k1": float(-d.mean()),
        "kl_k3": float((torch.expm1(clamped) - clamped).mean()),
        "chi2": float(torch.expm1(2 * clamped).mean()),
        "mult_prob_error": float(clamped.abs().exp().mean()),
        "abs_delta_mean": float(d.abs().mean()),
        "abs_delta_max": float(d.abs().max()),
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ess": float(ratio.mean().square() / ratio.square().mean()),
    }


def _log(x: float) -> float:
    """log(x), with log(0) = -inf and log(inf) = inf."""
    return -math.inf if x <= 0 else math.log(x)
