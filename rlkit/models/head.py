"""The LM head fused with the log-softmax: per-token log-probs (and entropies) without the [N, V] logits.

:class:`ResponseHead` stands in for a causal LM's ``lm_head`` (the same weight Parameter, so tied
embeddings, parameter names and FSDP's sharding are unchanged). Called plainly it is the linear layer it
replaced (generate and ordinary forwards see logits); inside :meth:`ResponseHead.scoring` it computes, in
the model's own forward (where FSDP has gathered the weight), the log-probs of given tokens at given rows
of the hidden states, chunk by chunk: each chunk's logits [C, V] exist only inside the chunk, and backward
recomputes them. Memory: one fp32 [C, V] chunk (C = CHUNK_ELEMENTS // V) and an fp32 [V, H] gradient
accumulator, instead of [N, V] logits and their fp32 copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from rlkit.models.packing import PACKABLE_MODEL_TYPES

CHUNK_ELEMENTS = 1 << 26
"""Logit entries per chunk (256 MiB in fp32): rows per chunk = CHUNK_ELEMENTS // V."""

ENTROPY_MODES = ("none", "detached", "grad")


@dataclass(frozen=True)
class HeadRequest:
    """What :class:`ResponseHead` computes during one forward (see :meth:`ResponseHead.scoring`)."""

    rows: torch.Tensor
    """[M] int64 indices into the hidden states flattened to [-1, H]: the positions that predict ``tokens``."""
    tokens: torch.Tensor
    """[M] int64 token ids whose log-probs are wanted."""
    temperature: float
    entropy: str
    """"none", "detached" or "grad" (see :data:`ENTROPY_MODES`)."""
    chunk_rows: int


class ResponseHead(nn.Linear):
    """A bias-free LM head that can return log-probs of chosen tokens instead of logits (see the module doc)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        if linear.bias is not None:
            raise ValueError("ResponseHead replaces bias-free LM heads only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tying and names are kept
        self.register_parameter("bias", None)
        self._request: HeadRequest | None = None

    @contextmanager
    def scoring(
        self, rows: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy: str, chunk_rows: int = 0
    ) -> Iterator[None]:
        """Within this block a forward of the model returns, as its ``logits``, an [M, 2] float32 tensor of
        (log-prob, entropy) (entropy 0 with ``entropy="none"``) of ``tokens`` [M] at hidden ``rows`` [M]."""
        if entropy not in ENTROPY_MODES:
            raise ValueError(f"entropy={entropy!r}: use one of {ENTROPY_MODES}")
        rows_per_chunk = chunk_rows or max(1, CHUNK_ELEMENTS // self.out_features)
        self._request = HeadRequest(rows, tokens, temperature, entropy, rows_per_chunk)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return nn.functional.linear(hidden, self.weight)
        chosen = hidden.reshape(-1, hidden.shape[-1]).index_select(0, request.rows)
        return linear_logprobs(
            chosen, self.weight, request.tokens, request.temperature, request.entropy, request.chunk_rows
        )


def install_response_head(model: nn.Module) -> bool:
    """Swap a causal LM's bias-free ``lm_head`` for a :class:`ResponseHead` on the same weight, before FSDP
    wrapping; True if done. Families outside PACKABLE_MODEL_TYPES keep theirs (their forward may transform
    the logits after the head) and take the plain log-prob path."""
    head = model.get_output_embeddings()
    if isinstance(head, ResponseHead):
        return True
    if model.config.model_type not in PACKABLE_MODEL_TYPES or type(head) is not nn.Linear or head.bias is not None:
        return False
    model.set_output_embeddings(ResponseHead(head))
    return True


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    entropy: str = "detached",
    chunk_rows: int = 0,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature) at ``tokens``, and the entropy, chunk by chunk.

    Args:
        hidden: [M, H] (any float dtype; the logits are computed in it, the softmax in fp32).
        weight: [V, H], same dtype.
        tokens: [M] int64.
        entropy: "none" (column 1 is 0), "detached" (no gradient through it) or "grad".
        chunk_rows: rows per chunk; default CHUNK_ELEMENTS // V.
    Returns:
        [M, 2] float32 (float64 for float64 inputs): log-probs and entropies, differentiable w.r.t. hidden
        and weight.
    """
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearLogprobs.apply(hidden, weight, tokens, temperature, entropy, rows)


class _LinearLogprobs(torch.autograd.Function):
    """Forward keeps one fp32 log-sum-exp (and entropy) per row; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature: float, entropy: str, rows: int):  # type: ignore[override]
        m = hidden.shape[0]
        wide = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.zeros(m, 2, dtype=wide, device=hidden.device)
        lse = torch.empty(m, dtype=wide, device=hidden.device)
        for s in range(0, m, rows):
            x = _scaled_logits(hidden[s : s + rows], weight, temperature)
            lse[s : s + rows] = norm = torch.logsumexp(x, dim=-1)
            out[s : s + rows, 0] = x.gather(-1, tokens[s : s + rows, None]).squeeze(-1) - norm
            if entropy != "none":
                out[s : s + rows, 1] = norm - (torch.softmax(x, dim=-1) * x).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse, out[:, 1].clone())
        ctx.temperature, ctx.rows, ctx.entropy = temperature, rows, entropy
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad_lp = grad_out[:, 0]
        grad_ent = grad_out[:, 1] if ctx.entropy == "grad" else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for s in range(0, hidden.shape[0], rows):
            h, chunk = hidden[s : s + rows], slice(s, s + rows)
            logp = _scaled_logits(h, weight, t).sub_(lse[chunk, None])
            g_ent = None if grad_ent is None else grad_ent[chunk]
            dz = _logit_grad(logp, tokens[chunk], grad_lp[chunk], ent[chunk], g_ent, t).to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[chunk] = dz @ weight
            if ctx.needs_input_grad[1]:
                grad_weight += dz.t() @ h
        grad_w = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w, None, None, None, None


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[C, V] logits / temperature of one chunk, in fp32 or wider (the matmul in the inputs' dtype, as lm_head)."""
    logits = hidden @ weight.t()
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)


def _logit_grad(
    logp: torch.Tensor,
    tokens: torch.Tensor,
    grad_lp: torch.Tensor,
    ent: torch.Tensor,
    grad_ent: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits [C, V] fp32 of one chunk from its log-softmax ``logp`` [C, V] (consumed in place).

    With x = logits / temperature and p = softmax(x): d logp[token] / dx = onehot - p and
    d entropy / dx = -p * (log p + entropy).
    """
    probs = logp.exp()
    if grad_ent is not None:
        logp.add_(ent[:, None]).mul_(probs).mul_(grad_ent[:, None])  # the entropy term, before probs is reused
    dx = probs.mul_(-grad_lp[:, None])
    if grad_ent is not None:
        dx.sub_(logp)
    dx.scatter_add_(-1, tokens[:, None], grad_lp[:, None])
    return dx.div_(temperature)
