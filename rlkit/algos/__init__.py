"""Pure torch RL math: advantages, policy losses, KL estimators. No distributed code."""

from rlkit.algos.advantages import grpo_advantages
from rlkit.algos.kl import kl_estimate
from rlkit.algos.losses import clipped_policy_loss, masked_mean

__all__ = ["clipped_policy_loss", "grpo_advantages", "kl_estimate", "masked_mean"]
