"""Load a model and tokenizer from a local directory; nothing is downloaded, no remote code by default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkit.models.attention import hf_attn_implementation
from rlkit.models.head import install_response_head


def resolve_model_dir(model: str) -> Path:
    """ "tiny" or "tiny-agent" -> the bundled model's folder; anything else must be a local Hugging Face directory."""
    from rlkit.models.tiny import BUNDLED_MODELS

    if model in BUNDLED_MODELS:
        return BUNDLED_MODELS[model]
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model={model!r}: no config.json there; give a local Hugging Face model directory or 'tiny'"
        )
    return path


@dataclass(frozen=True)
class ModelLimits:
    """What a model takes: token ids in [0, ``vocab_size``), sequences of at most ``context`` positions."""

    vocab_size: int
    context: int


def model_limits(model_dir: Path) -> ModelLimits:
    """The limits a model directory's config.json states (``vocab_size``, ``max_position_embeddings``; a
    multimodal config's ``text_config``); ValueError when it states neither."""
    config = json.loads((model_dir / "config.json").read_text())
    text = {**config.get("text_config", {}), **config}
    if not isinstance(text.get("vocab_size"), int) or not isinstance(text.get("max_position_embeddings"), int):
        raise ValueError(f"{model_dir}/config.json states no vocab_size and max_position_embeddings: rlkit cannot "
                         "check token ids and lengths against this model")  # fmt: skip
    return ModelLimits(text["vocab_size"], text["max_position_embeddings"])


def load_tokenizer(model_dir: Path, *, trust_remote_code: bool = False):
    """The directory's tokenizer, padding on the left (prompts) with a pad token set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
):
    """A causal LM in ``dtype`` on ``device``, in train mode with dropout off (RL wants deterministic log-probs).

    ``attn_implementation`` is rlkit's setting (rlkit.models.attention). Families rlkit can fuse get a
    :class:`~rlkit.models.head.ResponseHead` as their ``lm_head`` (same weight; plain logits unless asked).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        local_files_only=True,
        attn_implementation=hf_attn_implementation(attn_implementation),
    )
    install_response_head(without_dropout(model))
    return model.to(device)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout's probability set to 0 (RL wants deterministic log-probs and values)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
