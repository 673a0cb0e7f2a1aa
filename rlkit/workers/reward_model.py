"""Runs on every rank: the reward-model role, a frozen sequence classifier scoring prompt + completion texts."""

from __future__ import annotations

from pathlib import Path

import torch

from rlkit.config import FSDPConfig
from rlkit.fsdp import apply_fsdp, build_mesh
from rlkit.models import load_tokenizer
from rlkit.models.value import load_reward_model, sequence_scores
from rlkit.runtime import Role, context


class RewardModelWorker(Role):
    """This rank's FSDP shard of a frozen sequence-classification model and its tokenizer.

    Every rank scores the same number of micro-batches, as FSDP's collectives require.
    """

    def __init__(
        self, path: str | Path, *, micro_batch_size: int, max_length: int, fsdp: FSDPConfig, trust_remote_code: bool
    ):
        ctx = context()
        self.micro = micro_batch_size
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
        out = []
        for i in range(0, len(texts), self.micro):
            enc = self.tokenizer(texts[i : i + self.micro], padding=True, return_tensors="pt")
            ids, mask = enc["input_ids"][:, -self.max_length :], enc["attention_mask"][:, -self.max_length :]
            out.append(sequence_scores(self.model, ids.to(self.device), mask.to(self.device)).cpu())
        return torch.cat(out)
