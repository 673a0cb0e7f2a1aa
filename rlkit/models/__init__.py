"""Loading local Hugging Face model directories, and the bundled tiny model."""

from rlkit.models.families import check_model_family
from rlkit.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir

__all__ = ["check_model_family", "load_causal_lm", "load_tokenizer", "resolve_model_dir"]
