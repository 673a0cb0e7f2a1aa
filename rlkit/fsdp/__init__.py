"""Sharding a model with FSDP, kept apart from model code."""

from rlkit.fsdp.apply import apply_fsdp, decoder_layers

__all__ = ["apply_fsdp", "decoder_layers"]
