"""Runs on every rank: the reward-model role, a frozen sequence classifier scoring prompt + completion texts."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from rlkit.config import FSDPConfig
from rlkit.fsdp import apply_fsdp, build_mesh
from rlkit.models import load_tokenizer
from rlkit.models.value import load_reward_model, sequence_scores
from rlkit.runtime import Role, context
from rlkit.workers.batches import in_micro_batches


class RewardModelWorker(Role):
    """This rank's FSDP shard of a frozen sequence-classification model and its tokenizer.

    Texts are scored in the update's micro-batches (``micro_batch_size`` texts, or ``max_tokens_per_micro_batch``
    real tokens), every rank the same number of them, as FSDP's collectives require.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        micro_batch_size: int,
        max_tokens_per_micro_batch: int = 0,
        max_length: int,
        fsdp: FSDPConfig,
        trust_remote_code: bool,
    ):
        ctx = context()
        self.micro, self.max_tokens = micro_batch_size, max_tokens_per_micro_batch
        self.max_length = max_length
        self.device = ctx.device
        self.tokenizer = load_tokenizer(Path(path), trust_remote_code=trust_remote_code)
        model = load_reward_model(
            Path(path), dtype=torch.float32, device=ctx.device, trust_remote_code=trust_remote_code
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)
        self.model = apply_fsdp(model, build_mesh(ctx.device.type, ctx.world_size, fsdp), fsdp)

    @torch.no_grad()
    def score(self, texts: list[str]) -> torch.Tensor:
        """[n] float32 scores; texts are left-padded and cut to their last ``max_length`` tokens."""
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"][:, -self.max_length :], enc["attention_mask"][:, -self.max_length :]
        ids, mask = ids.to(self.device), mask.to(self.device)
        scores = in_micro_batches(partial(sequence_scores, self.model), ids, mask, self.micro, self.max_tokens)
        return scores.cpu()
