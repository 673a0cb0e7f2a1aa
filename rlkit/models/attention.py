"""The attention setting: which kernel a model's attention runs, for padded rows and for packed ones.

How transformers (5.17-5.19) treats a packed row (several sequences in one row, ``position_ids``
restarting at 0 for each, ``attention_mask=None``) under each implementation:

- "sdpa": ``create_causal_mask`` detects the restarts (``find_packed_sequence_indices``) and builds a
  DENSE [1, 1, N, N] boolean block-causal mask; SDPA with a mask cannot use its flash kernel and
  computes all N x N scores (GQA heads are repeated too). Correct, but quadratic in the packed length N:
  a micro-batch of 64 rows of 320 tokens packs to N = 20,480, i.e. 64x the attention work of the
  padded rows. rlkit therefore never hands packed rows to plain SDPA: "sdpa" loads the model with
  :data:`VARLEN_SDPA`, an attention function of rlkit's that runs packed rows through torch's own
  variable-length flash kernel (``torch.nn.attention.varlen``, CUDA, bf16/fp16; no extra package) and
  otherwise (CPU, fp32) one SDPA call per sequence; padded rows go to transformers' SDPA unchanged.
- "eager": the same dense mask, as an additive float [1, 1, N, N], and N x N attention weights per
  head: not offered.
- "flash_attention_2": no mask; given ``cu_seq_lens_q/k`` and ``max_length_q/k`` (which rlkit passes)
  it calls ``flash_attn_varlen_func``: linear in N. Needs the flash-attn package (CUDA).
- "flex_attention": the same detection builds a BlockMask (document-causal, block-sparse: blocks of
  other sequences are skipped) with a compiled ``create_block_mask`` on every forward. On CPU flex
  attention runs forward only (torch 2.13 has no CPU backward), so it cannot train there.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

VARLEN_SDPA = "rlkit_sdpa_varlen"
"""The transformers attention name rlkit registers for "sdpa" (it contains "sdpa" so that transformers
checks the model supports SDPA)."""


def hf_attn_implementation(attn_implementation: str) -> str:
    """The name to give transformers' ``from_pretrained(attn_implementation=...)`` (registers rlkit's own)."""
    if attn_implementation != "sdpa":
        return attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)
    return VARLEN_SDPA


def _varlen_sdpa_mask(*, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask without padding (packed rows carry cu_seq_lens instead); else transformers' SDPA mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, N, H, D].

    Packed rows (``cu_seq_lens_q`` [S + 1] int32 given, ``max_length_q`` the longest sequence) attend
    within their own sequence only; anything else is transformers' SDPA.
    """
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None or dropout:
        raise ValueError("packed attention supports neither sliding windows nor attention dropout")
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        out = _flash_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            cu_seq_lens_q, int(max_length_q or query.shape[2]), scaling)
        return out.unsqueeze(0), None
    return _per_sequence_sdpa(query, key, value, cu_seq_lens_q, scaling), None


def _per_sequence_sdpa(query, key, value, cu_seq_lens: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal SDPA on each sequence of a packed row (no kernel spans sequences): [1, H, N, D] -> [1, N, H, D]."""
    bounds = cu_seq_lens.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=True
        )
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        if e > s
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def _flash_varlen(q, k, v, cu_seq_lens: torch.Tensor, max_length: int, scaling: float | None) -> torch.Tensor:
    """torch's variable-length flash attention, causal: q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]."""
    from torch.nn.attention.varlen import varlen_attn as kernel

    varlen_attn: Any = kernel  # its keywords differ between torch versions
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 takes is_causal, later ones window_size; 2.13 asks for enable_gqa, earlier kernels take
    # fewer kv heads as they are
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scaling, **causal, **gqa)
