"""The controller's side of a reward model: a reward callable that has the workers' RewardModelWorker score texts."""

from __future__ import annotations

import torch

from rlkit.config import RLConfig
from rlkit.data.rewards import RewardError
from rlkit.runtime import Cluster, PerRank, RemoteError, RoleGroup, RoleOwner
from rlkit.workers import RewardModelWorker


class ModelReward:
    """``fn(prompts, completions, **fields) -> list[float]`` like any reward function, scored on the workers.

    Texts are prompt + completion, split evenly over the ranks. A rank that raised becomes a
    RewardError (the cluster still works; the step can be retried); a dead, hung or broken cluster
    surfaces as itself (WorkerDied, WorkerHung, ClusterBroken): nothing can be retried on it.
    """

    __name__ = "reward_model"

    def __init__(self, cluster: Cluster, config: RLConfig, owner: RoleOwner):
        self.cluster = cluster
        self.workers = RoleGroup(
            cluster,
            RewardModelWorker,
            config.reward_model.path,
            micro_batch_size=config.micro_batch_size,
            max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
            max_length=config.data.max_prompt_tokens + config.rollout.max_new_tokens,
            fsdp=config.fsdp,
            trust_remote_code=config.trust_remote_code,
            owner=owner,
        )

    def __call__(self, prompts: list[str], completions: list[str], **fields: object) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        ranks = self.cluster.world_size
        size = -(-len(texts) // ranks)
        # every rank scores the same number of texts (FSDP needs equal forward counts): pad with the last one
        padded = texts + texts[-1:] * (size * ranks - len(texts))
        chunks = [padded[r * size : (r + 1) * size] for r in range(ranks)]
        try:
            scores = torch.cat(self.workers.call(RewardModelWorker.score, PerRank(chunks)))
        except RemoteError as exc:  # a collective call: re-running it per sample to find one is no help
            raise RewardError(f"the reward model failed on the workers: {exc}") from exc
        return scores[: len(texts)].tolist()
