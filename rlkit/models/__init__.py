"""Loading local Hugging Face model directories, and the bundled tiny model."""

from rlkit.models.families import check_model_family, decoder_layers, describe_lora, model_family_problems
from rlkit.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir

__all__ = [
    "check_model_family",
    "decoder_layers",
    "load_causal_lm",
    "load_tokenizer",
    "model_family_problems",
    "describe_lora",
    "resolve_model_dir",
]
