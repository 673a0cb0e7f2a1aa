"""Loading local Hugging Face model directories, and the bundled tiny model."""

from rlkit.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir

__all__ = ["load_causal_lm", "load_tokenizer", "resolve_model_dir"]
