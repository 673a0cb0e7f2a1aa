"""The actor's per-token objective: policy loss (built-in PPO clip or the user's), KL term, entropy bonus."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.config import RLConfig

PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
"""``fn(logprobs, old_logprobs, advantages, response_mask) -> (loss, clipped)``, all [B, T]:
the per-token loss to minimise (rlkit aggregates it with ``loss_agg``) and a 0/1 float marking
tokens whose gradient a clip removed (for policy/clipfrac; zeros if there is no clip)."""

STAT_NAMES = ("loss", "clipped", "kl", "entropy", "approx_kl", "tokens", "steps")
"""The float64 sums an actor step returns, in order (``loss`` is this rank's share of the aggregate)."""


class PolicyObjective:
    """Turns one micro-batch's log-probs and entropies into its share of the loss and its stat sums."""

    def __init__(self, config: RLConfig, policy_loss_fn: PolicyLossFn | None = None):
        self.config = config
        self.policy_loss_fn = policy_loss_fn
        self.name = getattr(policy_loss_fn, "__name__", repr(policy_loss_fn)) if policy_loss_fn else "ppo_clip"

    def per_token_policy_loss(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The user's policy_loss_fn (shape-checked) or PPO's clip with the config's clip settings. [b, T] each."""
        cfg = self.config
        if self.policy_loss_fn is None:
            return clipped_policy_loss(
                logprobs, old_logprobs, advantages, cfg.clip_eps, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip
            )
        out = self.policy_loss_fn(logprobs, old_logprobs, advantages, mask)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and all(isinstance(t, torch.Tensor) and t.shape == logprobs.shape for t in out)
        ):
            raise ValueError(
                f"policy_loss_fn {self.name!r} must return (loss, clipped), two tensors of shape "
                f"{list(logprobs.shape)} (per token); got {_describe(out)}"
            )
        return out

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, micro: dict[str, torch.Tensor], weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and stats of one micro-batch.

        Args:
            logprobs: [b, T] current log-probs of the sampled tokens (with grad).
            entropy: [b, T] entropy of the sampling distribution (with grad if entropy_coef > 0).
            micro: response_mask, logprobs (old) [b, T]; advantages [b] or [b, T]; ref_logprobs [b, T] if any.
            weights: [b, T] aggregation weights (see rlkit.algos.loss_weights).
        Returns:
            sum(weights * per_token_loss) and [6] float64 sums (STAT_NAMES without "steps").
        """
        cfg = self.config
        mask = micro["response_mask"]
        advantages = micro["advantages"]
        if advantages.ndim == 1:
            advantages = advantages.unsqueeze(1).expand_as(logprobs)
        per_token, clipped = self.per_token_policy_loss(logprobs, micro["logprobs"], advantages, mask)
        kl = torch.zeros_like(per_token)
        if cfg.kl_mode == "loss" and cfg.kl_coef > 0 and "ref_logprobs" in micro:
            kl = kl_estimate(logprobs, micro["ref_logprobs"], cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy
        loss = (per_token * weights).sum()
        approx_kl = kl_estimate(micro["logprobs"], logprobs.detach(), "k3")
        sums = [loss, clipped, kl, entropy, approx_kl]
        stats = torch.stack([sums[0]] + [(s * mask).sum() for s in sums[1:]] + [mask.sum()]).detach()
        return loss, stats.to(torch.float64)


def policy_metrics(totals: torch.Tensor, world_size: int) -> dict[str, float]:
    """Metrics from STAT_NAMES sums all-reduced over ranks and accumulated over optimizer steps."""
    s = dict(zip(STAT_NAMES, totals.tolist(), strict=True))
    steps, tokens = s["steps"] / world_size, max(s["tokens"], 1.0)
    return {
        "policy/loss": s["loss"] / steps,
        "policy/clipfrac": s["clipped"] / tokens,
        "policy/approx_kl": s["approx_kl"] / tokens,
        "policy/entropy": s["entropy"] / tokens,
        "policy/kl_loss": s["kl"] / tokens,
    }


def _describe(out: object) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in out) + ")"
    return type(out).__name__
