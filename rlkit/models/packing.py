"""Padding-free rows: a micro-batch's sequences packed into one row, and where its response tokens sit.

Rows come laid out ``[prompt, left-padded | response, right-padded]`` ([b, L], L = P + T; the mask is 1
on real tokens). Packing keeps the real tokens only, in order, in one row [1, N] whose position ids
restart at 0 for each sequence (the ids the padded row would give them, so the two agree), and passes
the sequence boundaries (``cu_seq_lens``) that varlen attention kernels need. The index math runs on
the host from one copy of the mask (one device sync per micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""Model families whose forward rlkit packs (and whose LM head it fuses with the log-softmax): their
causal-LM forward applies ``lm_head`` to the hidden states and nothing after it, and their attention
takes transformers' varlen keyword arguments."""


def packing_unsupported(config) -> str:
    """Why a transformers config's model cannot be packed ("" when it can)."""
    model_type = getattr(config, "model_type", "")
    if model_type not in PACKABLE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {PACKABLE_MODEL_TYPES}"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "it has sliding-window attention layers"
    return ""


def can_pack(model) -> bool:
    """Whether :func:`pack_rows` may feed ``model`` (a transformers model, FSDP-wrapped or not)."""
    return not packing_unsupported(model.config)


@dataclass(frozen=True)
class PackedRows:
    """One packed row and what the model's varlen attention needs to keep its sequences apart."""

    input_ids: torch.Tensor
    """[1, N] the real tokens of every row, row after row."""
    position_ids: torch.Tensor
    """[1, N] restarting at 0 for each sequence."""
    cu_seq_lens: torch.Tensor
    """[S + 1] int32 cumulative sequence lengths (S rows with at least one token)."""
    max_length: int
    index: torch.Tensor
    """[b * L] int64: the packed position of each padded position (-1 at padding)."""

    def model_kwargs(self) -> dict[str, object]:
        """Keyword arguments of a transformers forward over the packed row (no attention mask, no cache)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "use_cache": False,
        }


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack [b, L] rows (real tokens where ``attention_mask`` is 1) into one row; see :class:`PackedRows`."""
    device = input_ids.device
    mask = attention_mask.to("cpu", torch.bool)
    lengths = mask.sum(1)
    real = mask.flatten().nonzero().squeeze(1)
    index = torch.full((mask.numel(),), -1, dtype=torch.long)
    index[real] = torch.arange(real.numel())
    positions = (mask.long().cumsum(1) - 1).flatten()[real]
    cu = torch.zeros(int((lengths > 0).sum()) + 1, dtype=torch.int32)
    cu[1:] = lengths[lengths > 0].cumsum(0)
    return PackedRows(
        input_ids=input_ids.flatten()[real.to(device)][None],
        position_ids=positions.to(device)[None],
        cu_seq_lens=cu.to(device),
        max_length=int(lengths.max()),
        index=index.to(device),
    )


@dataclass(frozen=True)
class ResponseSlots:
    """Where each real response token is predicted, what it is, and where its value goes in [b, T]."""

    rows: torch.Tensor
    """[M] int64 indices into the model's hidden states flattened to [-1, H] (padded or packed)."""
    tokens: torch.Tensor
    """[M] int64 the response tokens."""
    flat: torch.Tensor
    """[M] int64 index of each into a [b * T] flattening of the response columns."""
    shape: tuple[int, int]
    """(b, T)."""

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[M] values -> [b, T], 0 at padded response positions (differentiable)."""
        b, t = self.shape
        return values.new_zeros(b * t).index_copy(0, self.flat, values).view(b, t)


def response_slots(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, packed: PackedRows | None = None
) -> ResponseSlots:
    """The slots of the last ``response_width`` columns' real tokens, in the padded rows or in ``packed``.

    The token at column c is predicted by the hidden state at column c - 1 of the same row; the first
    response token's predictor is the last prompt token (prompts are never empty).
    """
    b, length = input_ids.shape
    t = response_width
    device = input_ids.device
    flat = attention_mask[:, -t:].to("cpu", torch.bool).flatten().nonzero().squeeze(1)
    predictor = (flat // t) * length + (length - t - 1) + flat % t
    flat, predictor = flat.to(device), predictor.to(device)
    rows = predictor if packed is None else packed.index[predictor]
    return ResponseSlots(rows=rows, tokens=input_ids[:, -t:].flatten()[flat], flat=flat, shape=(b, t))
