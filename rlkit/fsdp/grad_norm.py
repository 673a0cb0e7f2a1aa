"""Gradient clipping by the true global norm, for FSDP1 and FSDP2."""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip gradients to ``max_norm`` (0 = measure only) and return the global norm over all ranks.

    FSDP1 parameters are plain local shards, so ``torch.nn.utils.clip_grad_norm_``
    would see only this rank's piece; FSDP1's own method reduces across ranks.
    FSDP2 parameters are DTensors, whose norm is already global.
    """
    limit = max_norm or math.inf
    if isinstance(model, FSDP):
        return model.clip_grad_norm_(limit).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.item()
