"""Pure torch RL math: advantage estimators, policy/value losses, KL estimators, loss aggregation.

No distributed code: every function works on whole tensors, so a notebook can call,
inspect and replace any of them.
"""

from rlkit.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageFn,
    AdvantageInputs,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    outcome_token_rewards,
    rloo_advantages,
)
from rlkit.algos.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_weights
from rlkit.algos.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty
from rlkit.algos.losses import (
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    masked_mean,
)
from rlkit.algos.metrics import Mean, token_mean
from rlkit.algos.objective import PolicyLossFn, PolicyObjective, policy_objective, value_objective

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "Mean",
    "PolicyLossFn",
    "PolicyObjective",
    "AdvantageFn",
    "AdvantageInputs",
    "aggregate_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "kl_reward_penalty",
    "loss_weights",
    "masked_mean",
    "masked_whiten",
    "outcome_token_rewards",
    "policy_objective",
    "rloo_advantages",
    "token_mean",
    "value_objective",
]
