"""Models with a scalar head: the critic's value model (one value per token) and reward models (one per sequence)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlkit.models.attention import hf_attn_implementation
from rlkit.models.loading import without_dropout
from rlkit.models.logprobs import position_ids_for
from rlkit.models.packing import pack_rows, response_slots


def load_value_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
):
    """A causal LM's backbone with a fresh linear head giving one value per token (AutoModelForTokenClassification,
    num_labels=1), dropout off. Seed the RNG first: every rank must draw the same head."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the head is missing from a causal LM's checkpoint by design: no load report
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            model_dir,
            num_labels=1,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            attn_implementation=hf_attn_implementation(attn_implementation),
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return without_dropout(model).to(device)


def value_head_name(model: torch.nn.Module) -> str:
    """The name of a token-classification model's head: its one top-level linear layer ("score" for Qwen2/Llama)."""
    heads = [name for name, module in model.named_children() if isinstance(module, torch.nn.Linear)]
    if len(heads) != 1:
        raise ValueError(f"{type(model).__name__} has {len(heads)} top-level linear layers {heads}, not one value head")
    return heads[0]


def response_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_width: int,
    padding_free: bool = False,
) -> torch.Tensor:
    """V(s_t) for each response token t, read at the position before it (as the policy's logits are).

    Args:
        input_ids, attention_mask: [B, P + T] prompt (left-padded) then response (right-padded).
        response_width: T.
        padding_free: pack the rows into one (a family of rlkit.models.packing.PACKABLE_MODEL_TYPES).
    Returns:
        [B, T] float32, 0 at padded response positions; differentiable when called under grad.
    """
    mask = attention_mask.to("cpu")
    if padding_free:
        packed = pack_rows(input_ids, mask)
        slots = response_slots(input_ids, mask, response_width, packed)
        out = model(**packed.model_kwargs())
    else:
        slots = response_slots(input_ids, mask, response_width)
        position_ids = position_ids_for(attention_mask)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return slots.scatter(out.logits.reshape(-1).index_select(0, slots.rows).float())


def load_reward_model(model_dir: Path, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """An AutoModelForSequenceClassification with one label, dropout off; raises ValueError naming the fix otherwise."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True
    )
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model {model_dir} has num_labels={model.config.num_labels}; a reward model gives one score "
            "per sequence (num_labels=1)"
        )
    return without_dropout(model).to(device)


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] float32 scores of left-padded sequences [B, L] (the model reads its head at the last token)."""
    position_ids = position_ids_for(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits[:, 0].float()
