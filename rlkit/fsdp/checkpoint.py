"""Sharded checkpoints (torch.distributed.checkpoint) and a Hugging Face export, for FSDP1 and FSDP2.

Both are collectives: every rank calls them. Directories are created by the
caller; atomic publication (write aside, then rename) is the caller's job too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rlkit.fsdp.full_params import clean_name

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
"""Files copied from the source model directory into an export (those that exist)."""


TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what trains: every parameter in full fine-tuning; the adapters (and their optimizer state)
alone with LoRA, whose frozen base is reloaded from the model directory."""


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts without frozen parameters (tied copies of frozen ones included,
    which ``ignore_frozen_params`` keeps)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    return {k: v for k, v in model_state.items() if k not in _frozen(model)}, optim_state


def _frozen(model: torch.nn.Module) -> set[str]:
    """Paths of the parameters that do not train (tied copies included), without FSDP1's wrapper segments."""
    return {clean_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Each rank writes its shards of the model's trained parameters and the optimizer state into ``directory``."""
    model_state, optim_state = _trained_state(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what :func:`save_sharded` wrote, resharding to this cluster's layout, in place."""
    model_state, optim_state = _trained_state(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))  # fills both in place
    loose = StateDictOptions(ignore_frozen_params=True, strict=False)  # the frozen base is not in the checkpoint
    result = set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=loose)
    missing = [k for k in result.missing_keys if clean_name(k) not in _frozen(model)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {directory} does not fit the model: missing {missing[:5]}, "
                           f"unexpected {list(result.unexpected_keys)[:5]}")


def export_hf(model: torch.nn.Module, directory: Path, source_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """Rank 0 writes ``model.safetensors`` plus config and tokenizer files copied from ``source_dir``.

    Tied weights are written once (as transformers does), so
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads it without rlkit.
    """
    on_gpu = next(model.parameters()).device.type == "cuda"
    # cpu_offload gathers to rank 0's host memory; on CPU it crashed FSDP1 (see CPU.md), and is not needed.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_gpu))
    if dist.get_rank() == 0:
        write_hf({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, model, directory, source_dir,
                 dtype=dtype)  # fmt: skip


def write_hf(
    state: dict[str, torch.Tensor], model: torch.nn.Module, directory: Path, source_dir: Path, *,
    dtype: torch.dtype | None = None,
) -> None:
    """Write full tensors by their Hugging Face names (``state``) as ``model.safetensors``, with the config and
    tokenizer files of ``source_dir``; ``model`` tells whether the output embedding is tied (written once)."""
    from safetensors.torch import save_file

    full = _untie(model, state)
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in full.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name in HF_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, directory / name)


def _untie(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the output embedding when it is tied to the input embedding (safetensors refuses shared storage)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        return {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state
