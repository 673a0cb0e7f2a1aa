"""Advantage estimators: plain functions on tensors, and a registry of them under one signature.

Layout: B sequences of T response tokens; ``response_mask`` [B, T] is 1 on tokens the
policy generated. Group estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) score each
sequence by its summed token rewards and compare it with the other samples of its prompt,
found by the group index (``AdvantageInputs.group``, ``Batch.group``), so rows may come in
any order and groups may differ in size (each needs >= 2 samples). Token-level estimators
(REINFORCE++, GAE) walk the tokens backwards and skip masked positions, so right padding and
masked interior tokens (e.g. tool output) are both handled. Masked entries are dropped with
``torch.where``, so NaN or inf in padding never reaches an advantage.
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


def group_index(group: torch.Tensor | int, size: int) -> torch.Tensor:
    """The [size] int64 group index of each row: ``group`` itself ([size] int64, any values, any order),
    or for an int G, contiguous blocks (rows g*G .. (g+1)*G - 1 form group g; size must divide by G)."""
    if isinstance(group, int):
        if group < 1:
            raise ValueError(f"group_size={group}: must be >= 1")
        if size % group:
            raise ValueError(f"rewards must be 1-D with a multiple of group_size={group} entries, got {size}")
        return torch.arange(size) // group
    if group.shape != (size,) or group.dtype.is_floating_point:
        raise ValueError(f"group must be a [B] = [{size}] integer tensor of group indices, got {_describe(group)}")
    return group.long()


def _grouped(rewards: torch.Tensor, group: torch.Tensor | int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] float32 rewards, [B] dense group ids 0..G-1), checking that every group has >= 2 samples."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D ([B] one per completion), got {tuple(rewards.shape)}")
    index = group_index(group, rewards.numel()).to(rewards.device)
    ids, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)
    small = ids[counts < 2].tolist()
    if small:
        raise ValueError(
            f"{name} needs >= 2 samples per group; group(s) {small[:10]} have fewer "
            "(sample group_size >= 2 completions per prompt and keep whole groups together)"
        )
    return rewards.float(), inverse


def _group_sum(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[B] each row's group total of ``values`` [B] (groups given by dense ids ``inverse``)."""
    totals = torch.zeros(int(inverse.max()) + 1, dtype=values.dtype, device=values.device)
    return totals.index_add_(0, inverse, values)[inverse]


def _group_totals(rewards: torch.Tensor, group: torch.Tensor | int, name: str) -> tuple[torch.Tensor, ...]:
    """(r, its group's size, its group's reward sum, dense group ids), each [B]."""
    values, inverse = _grouped(rewards, group, name)
    return values, _group_sum(torch.ones_like(values), inverse), _group_sum(values, inverse), inverse


def grpo_advantages(
    rewards: torch.Tensor, group: torch.Tensor | int, *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024): (r - group mean) / (group std + eps).

    Args:
        rewards: [B] one scalar reward per completion.
        group: [B] int64 group index (completions of one prompt share it; any order, any group sizes
            >= 2), or an int G for contiguous blocks of G rows (see :func:`group_index`).
        scale: divide by the group's standard deviation (unbiased, as in the DeepSeekMath paper); False
            gives Dr.GRPO's mean-centred form (Liu et al. 2025).
        eps: added to the std so that a group of equal rewards gives 0.

    Returns:
        [B] advantages, float32.

    Example:
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)  # two groups of 2; equal rewards give 0
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    values, counts, sums, inverse = _group_totals(rewards, group, "GRPO")
    centred = values - sums / counts
    if not scale:
        return centred
    std = (_group_sum(centred.square(), inverse) / (counts - 1)).sqrt()
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor | int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each reward minus the mean of the *other* n-1 in its group.

    Args:
        rewards: [B]; group: as in :func:`grpo_advantages` (every group >= 2 samples).
    Returns:
        [B] float32; equals n/(n-1) * (r - group mean) for a group of n.
    """
    values, counts, sums, _ = _group_totals(rewards, group, "RLOO (a baseline from the other samples)")
    return values - (sums - values) / (counts - 1)


def reinforce_baseline_advantages(
    rewards: torch.Tensor, group: torch.Tensor | int, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025; OpenRLHF's and verl's "reinforce_baseline"/"reinforce_plus_plus_baseline").

    Each reward minus its group's mean, spread over the sequence's tokens, then whitened over all
    masked-in tokens of the batch (so a sequence weighs by its length, as in the peers).

    Args:
        rewards: [B]; group: as in :func:`grpo_advantages`; response_mask: [B, T].
    Returns:
        [B, T] float32, 0 where masked.
    """
    values, counts, sums, _ = _group_totals(rewards, group, "REINFORCE++-baseline")
    per_token = torch.where(response_mask > 0, (values - sums / counts).unsqueeze(1), 0.0)
    return masked_whiten(per_token, response_mask)


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over masked-in tokens: G_t = r_t + gamma * G_next, where next is the next masked-in token.

    Shapes: [B, T] each; returns [B, T] float32, 0 where the mask is 0.
    """
    keep = response_mask > 0
    mask, rewards = keep.float(), torch.where(keep, token_rewards.float(), 0.0)
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
    keep = response_mask > 0
    mask = keep.float()
    rewards, values = torch.where(keep, token_rewards.float(), 0.0), torch.where(keep, values.float(), 0.0)
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
    """(x - mean) / std over masked-in entries (std unbiased); 0 where masked (NaN there is ignored).
    Shapes: [B, T] each."""
    keep = response_mask > 0
    n = keep.sum()
    centred = torch.where(keep, values, 0.0) - torch.where(keep, values, 0.0).sum() / n.clamp(min=1)
    var = torch.where(keep, centred, 0.0).square().sum() / (n - 1).clamp(min=1)
    return torch.where(keep, centred * torch.rsqrt(var + eps), 0.0)


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """What every advantage estimator receives (B sequences, T response tokens)."""

    token_rewards: torch.Tensor
    """[B, T] float32: each sequence's reward on its last token, minus per-token KL penalties when
    the KL is a reward penalty."""
    response_mask: torch.Tensor
    """[B, T] 1 on generated tokens."""
    group_size: int
    """Completions sampled per prompt (the config's group_size)."""
    group: torch.Tensor | None = None
    """[B] int64 group index (rows of one prompt share it; ``Batch.group``): the group estimators group by
    it, in any row order. None: contiguous blocks, rows ``g*G .. (g+1)*G - 1`` form group g."""
    values: torch.Tensor | None = None
    """[B, T] critic values at rollout time (PPO), else None."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 1.0
    """GAE's lambda."""

    @property
    def scores(self) -> torch.Tensor:
        """[B] summed token rewards per sequence (what sequence-level estimators compare)."""
        return torch.where(self.response_mask > 0, self.token_rewards, 0.0).sum(dim=1)

    @property
    def groups(self) -> torch.Tensor | int:
        """What the group estimators group by: ``group`` if given, else ``group_size`` (contiguous blocks)."""
        return self.group_size if self.group is None else self.group


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
"""``fn(inputs) -> (advantages [B, T], returns [B, T])``; returns are the critic's targets
(estimators without a critic return the advantages again)."""


def _per_token(per_sequence: torch.Tensor, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.where(x.response_mask > 0, per_sequence.unsqueeze(1), 0.0)
    return adv, adv


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.values is None:
        raise ValueError('the "gae" estimator needs critic values: use rlkit.PPOConfig (it trains a critic)')
    advantages, returns = gae_advantages(x.token_rewards, x.values, x.response_mask, gamma=x.gamma, lam=x.lam)
    return masked_whiten(advantages, x.response_mask), returns


def _reinforce_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = reinforce_baseline_advantages(x.scores, x.groups, x.response_mask)
    return adv, adv


def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    returns = discounted_returns(x.token_rewards, x.response_mask, x.gamma)
    return masked_whiten(returns, x.response_mask), returns


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageFn] = types.MappingProxyType(
    {
        "grpo": lambda x: _per_token(grpo_advantages(x.scores, x.groups), x),
        "drgrpo": lambda x: _per_token(grpo_advantages(x.scores, x.groups, scale=False), x),
        "rloo": lambda x: _per_token(rloo_advantages(x.scores, x.groups), x),
        "reinforce++-baseline": _reinforce_baseline,
        "reinforce++": _reinforce_pp,
        "gae": _gae,
    }
)
"""Estimators by name. "grpo": group mean and std; "drgrpo": group mean only; "rloo":
leave-one-out mean; "reinforce++-baseline" (Hu et al. 2025): group mean subtracted, then whitened
over the batch's tokens; "reinforce++" (Hu et al. 2025): discounted returns whitened over the batch;
"gae": GAE with the critic's values, advantages whitened over the batch (PPO practice)."""

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++-baseline")
"""Estimators that compare samples of one prompt (they need group_size >= 2)."""


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
