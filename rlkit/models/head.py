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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from rlkit.models.packing import PACKABLE_MODEL_TYPES

CHUNK_ELEMENTS = 1 << 27
"""Logit entries per chunk (512 MiB in fp32): rows per chunk = CHUNK_ELEMENTS // V (883 at V = 151,936).
Fewer, larger chunks mean fewer passes over the fp32 [V, H] weight-gradient accumulator."""

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
        self._math: ChunkMath = EAGER

    def compile_chunk_math(self) -> None:
        """Run each chunk's elementwise math compiled from now on (``FSDPConfig.compile`` does this)."""
        self._math = compiled_chunk_math()

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
            chosen, self.weight, request.tokens, request.temperature, request.entropy, request.chunk_rows, self._math
        )


def response_head(model: nn.Module) -> ResponseHead | None:
    """The model's :class:`ResponseHead`, if it has one (FSDP-wrapped or not)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, ResponseHead) else None


def install_response_head(model: Any) -> bool:
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
    math: ChunkMath | None = None,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature) at ``tokens``, and the entropy, chunk by chunk.

    Args:
        hidden: [M, H] (any float dtype; the logits are computed in it, the softmax in fp32).
        weight: [V, H], same dtype.
        tokens: [M] int64.
        entropy: "none" (column 1 is 0), "detached" (no gradient through it) or "grad".
        chunk_rows: rows per chunk; default CHUNK_ELEMENTS // V.
        math: the per-chunk math (default :data:`EAGER`; :func:`compiled_chunk_math` fuses it).
    Returns:
        [M, 2] float32 (float64 for float64 inputs): log-probs and entropies, differentiable w.r.t. hidden
        and weight.
    """
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearLogprobs.apply(hidden, weight, tokens, temperature, entropy, rows, math or EAGER)


class ChunkMath(NamedTuple):
    """The per-chunk elementwise math of :func:`linear_logprobs` (eager, or compiled into fewer passes)."""

    stats: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    grad: Callable[..., torch.Tensor]


def _chunk_stats(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's log-probs of ``tokens``, log-sum-exps and entropies (0 without), from logits [C, V]."""
    x = _widened(logits).div_(temperature)
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(x, dim=-1) * x).sum(-1) if with_entropy else torch.zeros_like(lse)
    return logprobs, lse, entropy


def _chunk_grad(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    grad_lp: torch.Tensor,
    grad_ent: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits [C, V] (in the logits' dtype) of one chunk, from its logits [C, V].

    With x = logits / temperature and p = softmax(x): d logp[token] / dx = onehot - p and
    d entropy / dx = -p * (log p + entropy).
    """
    logp = _widened(logits).div_(temperature).sub_(lse[:, None])
    probs = logp.exp()
    if grad_ent is not None:
        logp.add_(ent[:, None]).mul_(probs).mul_(grad_ent[:, None])  # the entropy term, before probs is reused
    dx = probs.mul_(-grad_lp[:, None])
    if grad_ent is not None:
        dx.sub_(logp)
    dx.scatter_add_(-1, tokens[:, None], grad_lp[:, None])
    return dx.div_(temperature).to(logits.dtype)


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 (or wider) copy of ``logits``."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)


EAGER = ChunkMath(_chunk_stats, _chunk_grad)


def compiled_chunk_math() -> ChunkMath:
    """:data:`EAGER` under torch.compile (inductor fuses each chunk's elementwise passes into a few)."""
    return ChunkMath(torch.compile(_chunk_stats), torch.compile(_chunk_grad))


class _LinearLogprobs(torch.autograd.Function):
    """Forward keeps one fp32 log-sum-exp (and entropy) per row; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx, hidden, weight, tokens, temperature: float, entropy: str, rows: int, math: ChunkMath
    ):
        m = hidden.shape[0]
        out = torch.empty(m, 2, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        lse = torch.empty_like(out[:, 0])
        for s in range(0, m, rows):
            chunk = slice(s, s + rows)
            out[chunk, 0], lse[chunk], out[chunk, 1] = math.stats(
                hidden[chunk] @ weight.t(), tokens[chunk], temperature, entropy != "none"
            )
        ctx.save_for_backward(hidden, weight, tokens, lse, out[:, 1].clone())
        ctx.temperature, ctx.rows, ctx.entropy, ctx.math = temperature, rows, entropy, math
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        grad_lp = grad_out[:, 0].contiguous()
        grad_ent = grad_out[:, 1].contiguous() if ctx.entropy == "grad" else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for s in range(0, hidden.shape[0], ctx.rows):
            h, chunk = hidden[s : s + ctx.rows], slice(s, s + ctx.rows)
            g_ent = None if grad_ent is None else grad_ent[chunk]
            dz = ctx.math.grad(h @ weight.t(), tokens[chunk], lse[chunk], ent[chunk], grad_lp[chunk], g_ent,
                               ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[chunk] = dz @ weight
            if ctx.needs_input_grad[1]:
                grad_weight += dz.t() @ h
        grad_w = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w, None, None, None, None, None
