"""Policy losses (PPO clip, GSPO, CISPO, SAPO) and their registry, the value loss and the entropy bonus, per token.

Aggregation over tokens is in :mod:`rlkit.algos.aggregation`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is > 0; masked entries are dropped (NaN or inf there is ignored), 0 for an
    empty mask. Shapes: [B, T] each; returns a scalar, or with ``dim`` the means along it (``dim=1``: [B])."""
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
    log_ratio_clamp: float = 20.0,
    response_mask: torch.Tensor | None = None,
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
        log_ratio_clamp: the log-ratio is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp (its
            gradient is 0 beyond; verl uses 20), so a log-ratio of +-1000 gives a finite loss, and 0 for a
            token with zero advantage.
        response_mask: [B, T]; where it is 0 the log-ratio and advantage are taken as 0 (loss 0, gradient 0),
            so NaN or inf in padding reach neither the loss nor the gradient. None: no masking.

    Returns:
        loss: [B, T] per-token loss, max(-A * r, -A * clip(r)) (then min(., -c * A) where A < 0).
        clipped: [B, T] 1.0 where a clip zeroed the token's gradient, else 0.0.
    """
    log_ratio, advantages = _masked_inputs(logprobs - old_logprobs, advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    return _clipped_surrogate(ratio, advantages, clip_eps, clip_high, dual_clip)


def gspo_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its per-token form GSPO-token.

    The importance ratio is the sequence's: s_i = exp(mean_t log(pi / pi_old)) over its masked-in tokens
    (the length-normalised sequence likelihood ratio). Each token carries s_i's value with its own
    gradient: s_i,t = sg[s_i] * pi_t / sg[pi_t], so d s_i,t / d logp_t = s_i, as verl's "gspo" loss.
    Then PPO's clip (and dual-clip, if set) acts on s_i,t. With a per-sequence advantage and
    "seq-mean-token-mean" aggregation this is exactly GSPO's sequence objective (TRL's
    importance_sampling_level="sequence" with loss_type="grpo"): same value, same gradient. The paper
    clips far tighter than PPO: clip_eps=3e-4, clip_high=4e-4.

    Args:
        new_logprobs, old_logprobs: [B, T] log-probs of the sampled tokens now and at sampling.
        advantages: [B] or [B, T] (per-token advantages are allowed, as GSPO-token).
        response_mask: [B, T]; padding (NaN or inf there included) counts nowhere.
        clip_eps, clip_high, dual_clip: as in :func:`clipped_policy_loss`.
        log_ratio_clamp: log s_i,t is clamped to [-log_ratio_clamp, log_ratio_clamp] (gradient 0 beyond).
    Returns:
        loss: [B, T] per-token loss (0 where masked); clipped: [B, T] 1.0 where a clip zeroed the gradient.
    """
    log_ratio, advantages = _masked_inputs(new_logprobs - old_logprobs, advantages, response_mask)
    mask = response_mask > 0
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    logp = torch.where(mask, new_logprobs, 0.0)
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()
    ratio = torch.exp(token_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_eps, clip_high, dual_clip)
    return torch.where(mask, loss, 0.0), clipped * mask


def ppo_clip_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clipped_policy_loss` with the mask required, in the keyword form :func:`gspo_policy_loss` shares."""
    return clipped_policy_loss(
        new_logprobs,
        old_logprobs,
        advantages,
        clip_eps,
        clip_high=clip_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        response_mask=response_mask,
    )


def cispo_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps: float,
    clip_high: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, detached importance ratio.

    L_t = -sg(clip(r_t, 1 - clip_eps, 1 + clip_high)) * A_t * logp_t, so dL/dlogp_t = -w_t * A_t: a clip
    scales a token's gradient, never zeroes it (PPO's clip drops the tokens it clips). The loss's value
    is not a surrogate of the return, its gradient is. verl ``loss_mode="cispo"`` clips the same way with
    ``clip_ratio_low``/``clip_ratio_high``; TRL ``loss_type="cispo"`` caps from above only, at ``epsilon_high``
    as an absolute ratio (recommended 5.0): that is clip_eps >= 1 (no lower clip), clip_high = 4 here.

    Args:
        new_logprobs, old_logprobs: [B, T]; advantages: [B] or [B, T]; response_mask: [B, T].
        clip_eps, clip_high: the weight is clipped to [1 - clip_eps, 1 + clip_high] (clip_high None: clip_eps);
            clip_eps >= 1 leaves it unbounded below.
        log_ratio_clamp: the log-ratio is clamped to +-this before exp.
    Returns:
        loss: [B, T] (0 where masked); clipped: [B, T] 1.0 where the weight was clipped (gradient scaled, kept).
    """
    log_ratio, advantages = _masked_inputs(new_logprobs - old_logprobs, advantages, response_mask)
    mask = response_mask > 0
    ratio = torch.exp(log_ratio.detach().clamp(-log_ratio_clamp, log_ratio_clamp))
    high = clip_eps if clip_high is None else clip_high
    weight = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = -weight * advantages * torch.where(mask, new_logprobs, 0.0)
    return torch.where(mask, loss, 0.0), ((weight != ratio) & mask).float()


def sapo_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025): a smooth gate on the ratio instead of a hard clip.

    L_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A_t with tau = tau_pos where A_t > 0, else tau_neg, so
    dL/dlogp_t = -4 sigmoid (1 - sigmoid) r_t A_t: -A_t at r = 1 (PPO's gradient on-policy), fading as the
    ratio leaves 1 (faster for negative advantages, tau_neg > tau_pos). verl ``loss_mode="sapo"`` (``tau_pos``,
    ``tau_neg``) and TRL ``loss_type="sapo"`` (``sapo_temperature_pos``, ``sapo_temperature_neg``) use the same
    defaults, and aggregate "seq-mean-token-mean" (set ``loss_agg`` to match them).

    Args:
        new_logprobs, old_logprobs: [B, T]; advantages: [B] or [B, T]; response_mask: [B, T].
        tau_pos, tau_neg: the gate's temperatures (> 0) for positive and non-positive advantages.
        log_ratio_clamp: the log-ratio is clamped to +-this before exp.
    Returns:
        loss: [B, T] (0 where masked); clipped: [B, T] zeros (no token's gradient is removed).
    """
    log_ratio, advantages = _masked_inputs(new_logprobs - old_logprobs, advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    return torch.where(response_mask > 0, loss, 0.0), torch.zeros_like(loss)


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """The settings the registered policy losses read (each reads its own; see :data:`POLICY_LOSSES`)."""

    clip_eps: float = 0.2
    """PPO, GSPO, CISPO: the ratio (CISPO: the weight) is clipped to [1 - clip_eps, 1 + clip_high]."""
    clip_high: float | None = None
    """Upper clip; None: clip_eps."""
    dual_clip: float | None = None
    """PPO, GSPO: the dual-clip constant (None: off)."""
    log_ratio_clamp: float = 20.0
    """Every loss: the log-ratio is clamped to +-this before exp."""
    sapo_tau_pos: float = 1.0
    """SAPO: the gate's temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """SAPO: the gate's temperature for non-positive advantages."""


RegisteredPolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossSettings], tuple[torch.Tensor, torch.Tensor]
]
"""``fn(new_logprobs, old_logprobs, advantages, response_mask, settings) -> (loss, clipped)``: [B, T] in
([B] or [B, T] advantages), [B, T] out."""


def _ppo_clip(new, old, advantages, mask, s: PolicyLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_clip_policy_loss(new, old, advantages, mask, clip_eps=s.clip_eps, clip_high=s.clip_high,
                                dual_clip=s.dual_clip, log_ratio_clamp=s.log_ratio_clamp)  # fmt: skip


def _gspo(new, old, advantages, mask, s: PolicyLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return gspo_policy_loss(new, old, advantages, mask, clip_eps=s.clip_eps, clip_high=s.clip_high,
                            dual_clip=s.dual_clip, log_ratio_clamp=s.log_ratio_clamp)  # fmt: skip


def _cispo(new, old, advantages, mask, s: PolicyLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return cispo_policy_loss(new, old, advantages, mask, clip_eps=s.clip_eps, clip_high=s.clip_high,
                             log_ratio_clamp=s.log_ratio_clamp)  # fmt: skip


def _sapo(new, old, advantages, mask, s: PolicyLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return sapo_policy_loss(new, old, advantages, mask, tau_pos=s.sapo_tau_pos, tau_neg=s.sapo_tau_neg,
                            log_ratio_clamp=s.log_ratio_clamp)  # fmt: skip


POLICY_LOSSES: Mapping[str, RegisteredPolicyLoss] = types.MappingProxyType(
    {"ppo_clip": _ppo_clip, "gspo": _gspo, "cispo": _cispo, "sapo": _sapo}
)
"""Policy losses by name (the config's ``policy_loss``), each ``fn(new_logprobs, old_logprobs, advantages,
response_mask, settings)``: "ppo_clip" (per-token ratio, PPO; :func:`ppo_clip_policy_loss`), "gspo" (sequence
ratio, GSPO-token; :func:`gspo_policy_loss`), "cispo" (clipped IS weight, gradient through the log-prob;
:func:`cispo_policy_loss`) and "sapo" (soft gate; :func:`sapo_policy_loss`)."""


def _masked_inputs(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-ratio and advantages, 0 where the mask is 0 (NaN-proof: torch.where, not a product)."""
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    if response_mask is None:
        return log_ratio, advantages
    mask = response_mask > 0
    return torch.where(mask, log_ratio, 0.0), torch.where(mask, advantages, 0.0)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float, clip_high: float | None, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's max(-A r, -A clip(r)), then the dual-clip cap; and 1.0 where a clip zeroed the gradient."""
    high = clip_eps if clip_high is None else clip_high
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
