"""The advantages phase on the controller: token rewards (with the KL penalty) -> an estimator -> advantages."""

from __future__ import annotations

import torch

from rlkit.algos import AdvantageFn, AdvantageInputs, compute_advantages, kl_reward_penalty, outcome_token_rewards
from rlkit.config import RLConfig
from rlkit.data.batch import Batch
from rlkit.trainer.agentic import ENVIRONMENT_TERM, turn_token_rewards


def advantage_inputs(batch: Batch, config: RLConfig) -> AdvantageInputs:
    """What the estimator sees: each reward on its sequence's last token, minus ``kl_coef`` times the
    per-token KL to the reference when ``kl_mode == "reward"``, plus the rollout-time values (PPO). With
    ``agent.turn_rewards`` an environment's rewards sit on the last model token of each turn instead."""
    rewards = batch.filled("rewards")
    turn_rewards = None
    if config.agent.turn_rewards and ENVIRONMENT_TERM in batch.reward_terms:
        rewards, turn_rewards = rewards - batch.reward_terms[ENVIRONMENT_TERM], turn_token_rewards(batch)
    token_rewards = outcome_token_rewards(rewards, batch.response_mask)
    if turn_rewards is not None:
        token_rewards = token_rewards + turn_rewards
    if config.kl_mode == "reward" and batch.ref_logprobs is not None:
        token_rewards = kl_reward_penalty(
            token_rewards,
            batch.filled("old_logprobs"),
            batch.ref_logprobs,
            batch.response_mask,
            coef=config.kl_coef,
            estimator=config.kl_estimator,
            clamp=config.kl_clamp,
            log_ratio_clamp=config.log_ratio_clamp,
        )
    return AdvantageInputs(
        token_rewards=token_rewards,
        response_mask=batch.response_mask,
        group_size=config.group_size,
        group=batch.group,
        values=batch.values,
        gamma=config.gamma,
        lam=config.lam,
    )


def estimate_advantages(
    batch: Batch, config: RLConfig, advantage_fn: AdvantageFn | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] advantages and returns from ``advantage_fn`` if given, else from the estimator ``config.advantage``."""
    return compute_advantages(advantage_fn or config.advantage, advantage_inputs(batch, config))
