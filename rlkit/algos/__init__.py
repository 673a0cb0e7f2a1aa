"""Pure torch RL math: advantage estimators, policy/value/preference losses, KL estimators, loss aggregation.

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
    group_index,
    grpo_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_baseline_advantages,
    rloo_advantages,
)
from rlkit.algos.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_weights, weighted_sum
from rlkit.algos.dapo import informative_groups, mask_truncated, overlong_penalty
from rlkit.algos.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty
from rlkit.algos.losses import (
    POLICY_LOSSES,
    ClipPolicyLossFn,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    gspo_policy_loss,
    masked_mean,
    ppo_clip_policy_loss,
)
from rlkit.algos.metrics import Mean, token_mean
from rlkit.algos.objective import PolicyLossFn, PolicyObjective, policy_objective, value_objective
from rlkit.algos.preference import (
    DPO_LOSSES,
    dpo_loss,
    kto_kl_baseline,
    kto_loss,
    kto_metrics,
    kto_mismatched_pairs,
    kto_sums,
    preference_metrics,
    preference_sums,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Mean",
    "PolicyLossFn",
    "PolicyObjective",
    "AdvantageFn",
    "AdvantageInputs",
    "ClipPolicyLossFn",
    "aggregate_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "group_index",
    "grpo_advantages",
    "gspo_policy_loss",
    "informative_groups",
    "kl_estimate",
    "kl_reward_penalty",
    "kto_kl_baseline",
    "kto_loss",
    "kto_metrics",
    "kto_mismatched_pairs",
    "kto_sums",
    "loss_weights",
    "mask_truncated",
    "masked_mean",
    "masked_whiten",
    "outcome_token_rewards",
    "overlong_penalty",
    "policy_objective",
    "ppo_clip_policy_loss",
    "preference_metrics",
    "preference_sums",
    "reinforce_baseline_advantages",
    "rloo_advantages",
    "token_mean",
    "value_objective",
    "weighted_sum",
]
