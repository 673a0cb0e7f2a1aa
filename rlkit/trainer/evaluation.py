"""The validation phase on the controller: sample the validation prompts on every rank, score them, reduce."""

from __future__ import annotations

from typing import Any

import torch

from rlkit.config import RLConfig
from rlkit.data import PromptSource, validation_metrics
from rlkit.data.rewards import WeightedReward, compute_rewards
from rlkit.rollout import SamplingParams
from rlkit.runtime import PerRank, RoleGroup
from rlkit.trainer.assemble import tokenize_prompts
from rlkit.trainer.model_reward import ModelReward
from rlkit.workers import PolicyWorker


def evaluate_prompts(
    policy: RoleGroup[PolicyWorker],
    tokenizer: Any,
    source: PromptSource,
    rewards: list[WeightedReward],
    reward_model: ModelReward | None,
    config: RLConfig,
    seed: int,
) -> dict[str, float]:
    """``validation.n`` samples of every validation prompt at ``validation.temperature`` (the prompts split over
    the ranks, unevenly if need be: generation has no collectives), scored by the run's rewards; the
    ``val/...`` metrics of :func:`rlkit.data.validation_metrics`. No model changes."""
    val, ranks = config.validation, policy.cluster.world_size
    items = source.items
    prompt_ids, prompt_mask = tokenize_prompts(
        tokenizer, [item["prompt"] for item in items], config.data.max_prompt_tokens, source.add_special_tokens
    )
    params = SamplingParams(
        n=val.n,
        max_new_tokens=config.rollout.max_new_tokens,
        min_new_tokens=config.rollout.min_new_tokens,
        temperature=val.temperature,
        top_p=config.rollout.top_p,
        seed=seed,
    )
    results = policy.call(
        PolicyWorker.sample,
        PerRank(list(prompt_ids.tensor_split(ranks))),
        PerRank(list(prompt_mask.tensor_split(ranks))),
        params,
    )
    response_ids = torch.cat([r.response_ids for r in results])
    completions = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    prompts = [item["prompt"] for item in items for _ in range(val.n)]
    fields = {k: [item[k] for item in items for _ in range(val.n)] for k in items[0] if k != "prompt"}
    scored = {}
    if reward_model is not None:
        scored["reward_model"] = (torch.tensor(reward_model(prompts, completions)), config.reward_model.weight)
    total, terms = compute_rewards(rewards, prompts, completions, fields, scored=scored)
    group = torch.arange(len(items)).repeat_interleave(val.n)
    return validation_metrics(total, terms, group)
