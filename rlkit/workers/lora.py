"""Runs on every rank: what a LoRA-trained policy sends its rollout engine, and its adapter export."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.config import LoraConfig
from rlkit.fsdp import iter_full_params
from rlkit.models.lora import is_adapter_param, merged_weights, save_adapter


def engine_weights(model: torch.nn.Module, lora: LoraConfig | None, sync: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs for the engine; a collective. Full fine-tuning: every parameter. LoRA with
    ``sync="merged"``: the base's names with the adapters merged in (fp32 math); ``"adapter"``: the adapters only."""
    if lora is None:
        return iter_full_params(model)
    if sync == "adapter":
        return iter_full_params(model, keep=is_adapter_param)
    return merged_weights(iter_full_params(model), lora.alpha / lora.rank)


def export_adapter(model: torch.nn.Module, directory: Path, lora: LoraConfig, base_model: str) -> None:
    """Rank 0 writes the adapters as a peft adapter directory; every rank gathers (a collective)."""
    weights = list(iter_full_params(model, keep=is_adapter_param))
    if dist.get_rank() == 0:
        save_adapter(directory, weights, lora, base_model)
