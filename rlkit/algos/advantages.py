"""Advantage estimators: plain functions on tensors, and a registry of them under one signature.

Layout: B sequences of T response tokens; ``response_mask`` [B, T] is 1 on tokens the
policy generated. Sequence-level estimators (GRPO, Dr.GRPO, RLOO) score each
sequence by its summed token rewards; token-level ones (REINFORCE++, GAE) walk the
tokens backwards and skip masked positions, so right padding and masked interior
tokens (e.g. tool output) are both handled.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


def outcome_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last response token.

    Args:
        rewards: [B] one scalar per sequence.
        response_mask: [B, T].
    Returns:
        [B, T] float32, zero except at each row's last masked-in position.
    """
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = (positions * (response_mask > 0)).argmax(dim=1)
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    out[torch.arange(len(rewards)), last] = rewards.float()
    return out * (response_mask > 0)


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024).

    Args:
        rewards: [B] one scalar reward per completion, where completions
            ``g*group_size .. (g+1)*group_size - 1`` answer the same prompt.
        group_size: completions per prompt (G); B must be a multiple of it.
        scale: divide by the group's standard deviation (unbiased, as in the
            DeepSeekMath paper); False gives Dr.GRPO's mean-centred form (Liu et al. 2025).
        eps: added to the std so that a group of equal rewards gives 0.

    Returns:
        [B] advantages, float32.
    """
    grouped = _groups(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each reward minus the mean of the *other* G-1 in its group.

    Args:
        rewards: [B], grouped as in :func:`grpo_advantages`; group_size >= 2.
    Returns:
        [B] float32; equals G/(G-1) * (r - group mean).
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a baseline from the other samples), got {group_size}")
    grouped = _groups(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over masked-in tokens: G_t = r_t + gamma * G_next, where next is the next masked-in token.

    Shapes: [B, T] each; returns [B, T] float32, 0 where the mask is 0.
    """
    mask = (response_mask > 0).float()
    rewards = token_rewards.float() * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = mask[:, t] * (rewards[:, t] + gamma * running) + (1 - mask[:, t]) * running
        out[:, t] = running
    return out * mask


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over masked-in tokens.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next"
    is the next masked-in token and V = A = 0 after the last one.

    Args:
        token_rewards: [B, T] reward per token (the outcome on the last token, KL penalties on each).
        values: [B, T] critic values V(s_t), s_t = prompt + response[:t].
        response_mask: [B, T].
        gamma: discount; lam: GAE's lambda (1 gives Monte-Carlo returns minus V, 0 one-step TD).
    Returns:
        advantages: [B, T] float32 (unwhitened), 0 where masked.
        returns: [B, T] float32, advantages + values (the critic's targets), 0 where masked.
    """
    mask = (response_mask > 0).float()
    rewards, values = token_rewards.float() * mask, values.float() * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv + (1 - m) * next_adv
        advantages[:, t] = adv
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def masked_whiten(values: torch.Tensor, response_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked-in entries (std unbiased); 0 where masked. Shapes: [B, T] each."""
    mask = (response_mask > 0).float()
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """What every advantage estimator receives (B sequences, T response tokens)."""

    token_rewards: torch.Tensor
    """[B, T] float32: each sequence's reward on its last token, minus per-token KL penalties when
    the KL is a reward penalty."""
    response_mask: torch.Tensor
    """[B, T] 1 on generated tokens."""
    group_size: int
    """Completions per prompt; rows ``g*G .. (g+1)*G - 1`` share a prompt."""
    values: torch.Tensor | None = None
    """[B, T] critic values at rollout time (PPO), else None."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 1.0
    """GAE's lambda."""

    @property
    def scores(self) -> torch.Tensor:
        """[B] summed token rewards per sequence (what sequence-level estimators compare)."""
        return (self.token_rewards * (self.response_mask > 0)).sum(dim=1)


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
"""``fn(inputs) -> (advantages [B, T], returns [B, T])``; returns are the critic's targets
(estimators without a critic return the advantages again)."""


def _per_token(per_sequence: torch.Tensor, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_sequence.unsqueeze(1) * (x.response_mask > 0)
    return adv, adv


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.values is None:
        raise ValueError('the "gae" estimator needs critic values: use rlkit.PPOConfig (it trains a critic)')
    advantages, returns = gae_advantages(x.token_rewards, x.values, x.response_mask, gamma=x.gamma, lam=x.lam)
    return masked_whiten(advantages, x.response_mask), returns


def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    returns = discounted_returns(x.token_rewards, x.response_mask, x.gamma)
    return masked_whiten(returns, x.response_mask), returns


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageFn] = types.MappingProxyType(
    {
        "grpo": lambda x: _per_token(grpo_advantages(x.scores, x.group_size), x),
        "drgrpo": lambda x: _per_token(grpo_advantages(x.scores, x.group_size, scale=False), x),
        "rloo": lambda x: _per_token(rloo_advantages(x.scores, x.group_size), x),
        "reinforce++": _reinforce_pp,
        "gae": _gae,
    }
)
"""Estimators by name. "grpo": group mean and std; "drgrpo": group mean only; "rloo":
leave-one-out mean; "reinforce++" (Hu 2025): discounted returns whitened over the batch;
"gae": GAE with the critic's values, advantages whitened over the batch (PPO practice)."""

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")
"""Estimators that compare samples of one prompt (they need group_size >= 2)."""


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    return rewards.float().view(-1, group_size)


def compute_advantages(estimator: str | AdvantageFn, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a registered estimator (by name) or a user's callable; check it returned two finite [B, T] tensors.

    Returns:
        advantages, returns: [B, T] float32, zeroed where the mask is 0 (whatever the estimator put there).
    """
    fn = ADVANTAGE_ESTIMATORS[estimator] if isinstance(estimator, str) else estimator
    name = estimator if isinstance(estimator, str) else getattr(fn, "__name__", repr(fn))
    out = fn(inputs)
    shape = tuple(inputs.response_mask.shape)
    if not (isinstance(out, tuple) and len(out) == 2 and all(_is_shaped(t, shape) for t in out)):
        got = tuple(_describe(t) for t in out) if isinstance(out, tuple) else _describe(out)
        raise ValueError(
            f"advantage estimator {name!r} must return (advantages, returns), "
            f"two [B, T] = {list(shape)} tensors; got {got}"
        )
    mask = inputs.response_mask > 0
    for label, t in zip(("advantages", "returns"), out, strict=True):
        bad = (~torch.isfinite(t) & mask).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"advantage estimator {name!r} returned non-finite {label} for sample(s) {bad[:10]}")
    advantages, returns = (torch.where(mask, t.float(), 0.0) for t in out)
    return advantages, returns


def _is_shaped(t: object, shape: tuple[int, ...]) -> bool:
    return isinstance(t, torch.Tensor) and tuple(t.shape) == shape


def _describe(t: object) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
