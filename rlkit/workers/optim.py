"""Runs on every rank: AdamW and its learning-rate schedule, built after FSDP wrapping.

Past ``total`` optimizer steps the schedule holds its last value: lr for "constant", and
``min_lr_ratio * lr`` for "cosine".
"""

from __future__ import annotations

import math

import torch

from rlkit.config import OptimConfig


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params, config: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` (an FSDP-wrapped model's) and its schedule over ``total_steps`` optimizer steps."""
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup=config.warmup_steps, total=total_steps, schedule=config.schedule, min_ratio=config.min_lr_ratio
        ),
    )
    return optimizer, scheduler
