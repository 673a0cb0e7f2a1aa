"""Sharding a model with FSDP2 or FSDP1, kept apart from model code; sharded checkpoints and HF export."""

from rlkit.fsdp.apply import apply_fsdp, build_mesh, decoder_layers, param_dtype
from rlkit.fsdp.full_params import iter_full_params
from rlkit.fsdp.grad_norm import clip_grad_norm

__all__ = ["apply_fsdp", "build_mesh", "clip_grad_norm", "decoder_layers", "iter_full_params", "param_dtype"]
