"""Tiny random-weight models of the families people post-train (Llama 3, Qwen2, Qwen3, Mistral, Gemma 2/3, Phi-3),
each built from its transformers config with the bundled tiny tokenizer; nothing is downloaded.

Every model has 2 decoder layers, hidden size 64 and 2 query / 1 KV heads of dim 32 (vLLM's CPU attention
rejects 16), and keeps what sets its family apart: Llama 3's rope scaling, Qwen2's qkv bias, Qwen3's q/k norms,
Mistral's and Gemma's sliding windows (8 tokens, shorter than a prompt plus completion, so the window is
exercised), Gemma's embedding scale, soft-capping and alternating layer types, Phi-3's fused qkv and gate/up
projections. Run ``python tests/family_models.py OUT`` to write them all into OUT (e.g. for a GPU run).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from rlkit.models.tiny import TINY_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 257
"""The bundled tokenizer's vocabulary (id 0 is end-of-text and pad)."""
SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)
SLIDING_WINDOW = 8

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=SLIDING_WINDOW)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32)),
    "phi3": ("Phi3Config", dict()),
}
"""Family -> (transformers config class, settings beyond :data:`SHAPE`)."""


def family_config(family: str, *, tied: bool):
    """The transformers config of ``family``'s tiny model, tied or untied input/output embeddings."""
    import transformers

    class_name, extra = FAMILIES[family]
    return getattr(transformers, class_name)(**SHAPE, **extra, tie_word_embeddings=tied, dtype="float32")


def build_family_model(family: str, out: Path, *, tied: bool, seed: int = 0) -> Path:
    """Write ``family``'s tiny model (random fp32 weights) and the bundled tokenizer into ``out``; returns ``out``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = family_config(family, tied=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy2(TINY_MODEL_DIR / name, out / name)
    return out


def model_name(family: str, tied: bool) -> str:
    """The folder name of a family's variant, e.g. ``llama3-tied``."""
    return f"{family}-{'tied' if tied else 'untied'}"


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for fam in FAMILIES:
        for tie in (True, False):
            build_family_model(fam, root / model_name(fam, tie), tied=tie)
            print(root / model_name(fam, tie))
