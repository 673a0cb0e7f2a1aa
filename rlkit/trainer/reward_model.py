"""A reward model on the workers: a sequence classifier that scores prompt + completion texts, in batches.

:class:`ModelReward` is the controller's side: a reward callable
``fn(prompts, completions, **fields) -> list[float]`` like any other, which
splits the texts over the ranks. Each rank holds an FSDP shard of the model
and runs the same number of micro-batches, as FSDP's collectives require.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlkit.config import config_from_dict
from rlkit.data.rewards import RewardError
from rlkit.fsdp import apply_fsdp, build_mesh
from rlkit.models import load_tokenizer
from rlkit.models.value import load_reward_model, sequence_scores
from rlkit.runtime import Cluster, PerRank, context

log = logging.getLogger(__name__)

STATE_KEY = "rlkit.reward_model"


class RewardModel:
    """This rank's shard of a frozen sequence-classification model and its tokenizer."""

    def __init__(self, path: Path, *, micro_batch_size: int, max_length: int, fsdp, trust_remote_code: bool):
        ctx = context()
        self.micro = micro_batch_size
        self.max_length = max_length
        self.tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        model = load_reward_model(path, dtype=torch.float32, device=ctx.device, trust_remote_code=trust_remote_code)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)
        self.model = apply_fsdp(model, build_mesh(ctx.device.type, ctx.world_size, fsdp), fsdp)
        self.device = ctx.device

    @torch.no_grad()
    def score(self, texts: list[str]) -> torch.Tensor:
        """[n] float32 scores; texts are left-padded and cut to the last ``max_length`` tokens."""
        out = []
        for i in range(0, len(texts), self.micro):
            enc = self.tokenizer(texts[i : i + self.micro], padding=True, return_tensors="pt")
            ids, mask = enc["input_ids"][:, -self.max_length :], enc["attention_mask"][:, -self.max_length :]
            out.append(sequence_scores(self.model, ids.to(self.device), mask.to(self.device)).cpu())
        return torch.cat(out)


def setup(config: dict) -> dict[str, object]:
    """Load the config's reward model on this rank (replacing any earlier one)."""
    ctx = context()
    ctx.state.pop(STATE_KEY, None)
    cfg = config_from_dict(config)
    ctx.state[STATE_KEY] = RewardModel(
        Path(cfg.reward_model.path),
        micro_batch_size=cfg.micro_batch_size,
        max_length=cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
        fsdp=cfg.fsdp,
        trust_remote_code=cfg.trust_remote_code,
    )
    log.info("reward model ready on %s", ctx.device)
    return {"device": str(ctx.device)}


def score(texts: list[str]) -> torch.Tensor:
    return context().state[STATE_KEY].score(texts)


class ModelReward:
    """The reward callable backed by the workers' reward model; texts are prompt + completion."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def __call__(self, prompts: list[str], completions: list[str], **fields: object) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        ranks = self.cluster.world_size
        size = -(-len(texts) // ranks)
        # every rank scores the same number of texts (FSDP needs equal forward counts): pad with the last one
        padded = texts + texts[-1:] * (size * ranks - len(texts))
        chunks = [padded[r * size : (r + 1) * size] for r in range(ranks)]
        try:
            scores = torch.cat(self.cluster.run(score, PerRank(chunks)))
        except Exception as exc:  # a collective call: re-running it per sample to find one is no help
            raise RewardError(f"the reward model failed on the workers: {exc}") from exc
        return scores[: len(texts)].tolist()
