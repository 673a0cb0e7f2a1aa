"""What a run trains on, from the controller's arguments and the config: the prompt source and the reward functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlkit.config import ConfigError, RLConfig
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import RewardFn

Rewards = RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn | tuple[RewardFn, float]]
"""One reward callable, a list of them (weight 1 each), or {name: fn or (fn, weight)}."""


def task_defaults(
    config: RLConfig, reward_fn: Rewards | None, prompts: Sequence[str | dict[str, Any]] | None
) -> tuple[Rewards | None, PromptSource]:
    """Fill in the bundled task for model="tiny"; any other model needs prompts, and reward_fn unless a
    reward model is configured. With a reward model and no reward_fn, the reward model alone scores."""
    has_rm = bool(config.reward_model.path)
    absent = (("reward_fn", reward_fn is None and not has_rm), ("prompts", prompts is None))
    missing = [name for name, is_absent in absent if is_absent]
    if config.model != "tiny" and missing:
        raise ConfigError([f"{' and '.join(missing)} missing: only model='tiny' has a bundled task and reward"])
    from rlkit.data.tasks import AdditionTask, addition_reward

    if prompts is not None:
        source = PromptSource(prompts, seed=config.seed)
    else:
        source = PromptSource(task=AdditionTask(), seed=config.seed)
    if reward_fn is None and not has_rm:
        reward_fn = addition_reward
    return reward_fn, source
