"""The LM head fused with the log-softmax: per-token log-probs (and entropies) without the [N, V] logits.

:class:`ResponseHead` stands in for a causal LM's ``lm_head`` (the same weight Parameter, so tied
embeddings, parameter names and FSDP's sharding are unchanged). Called plainly it is the linear layer it
replaced (generate and ordinary forwards see logits); inside :meth:`ResponseHead.scoring` it computes, in
the model's own forward (where FSDP has gathered the weight), the log-probs of given tokens at given rows
of the hidden states, chunk by chunk: each chunk's logits [C, V] exist only inside the chunk, and backward
recomputes them. Memory: one [C, V] chunk and an fp32 [V, H] gradient accumulator, instead of [N, V] logits
and their fp32 copies.

Each chunk's elementwise math (the fp32 log-softmax, the entropy, their gradient) runs eagerly on a CPU
(:data:`EAGER`: several fp32 passes over [C, V], C = CHUNK_ELEMENTS // V) and compiled on a GPU
(:func:`fused_chunk_math`: inductor fuses each function into a few kernels that read the bf16 logits and
keep no fp32 copy, so the chunks are larger, FUSED_CHUNK_ELEMENTS); if compiling fails there, it logs why
once and runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from rlkit.models.packing import PACKABLE_MODEL_TYPES

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 27
"""Logit entries per chunk of the eager math (512 MiB in fp32): rows per chunk = CHUNK_ELEMENTS // V (883 at
V = 151,936). Fewer, larger chunks mean fewer passes over the fp32 [V, H] weight-gradient accumulator."""
FUSED_CHUNK_ELEMENTS = 1 << 28
"""The same for the compiled math, which keeps no fp32 copy of a chunk: its bf16 logits and, in backward, their
bf16 gradient (1 GiB together) are less than the eager math's fp32 copies of half as many entries."""

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
    """Rows per chunk; 0: the chunk math's ``chunk_elements // V``."""


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
        self._math: ChunkMath | None = None
        """None until the first scoring forward picks it by device (:func:`default_chunk_math`)."""

    @property
    def chunk_math(self) -> ChunkMath | None:
        """The per-chunk math in use (None before the first scoring forward)."""
        return self._math

    def use_chunk_math(self, math: ChunkMath) -> None:
        """Run each chunk's elementwise math as ``math`` from now on (:data:`EAGER` or :func:`fused_chunk_math`;
        ``FSDPConfig.compile`` asks for the fused math on any device)."""
        self._math = math

    def compile_chunk_math(self) -> None:
        """Run each chunk's elementwise math compiled from now on, on any device (``FSDPConfig.compile``)."""
        self.use_chunk_math(fused_chunk_math())

    @contextmanager
    def scoring(
        self, rows: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy: str, chunk_rows: int = 0
    ) -> Iterator[None]:
        """Within this block a forward of the model returns, as its ``logits``, an [M, 2] float32 tensor of
        (log-prob, entropy) (entropy 0 with ``entropy="none"``) of ``tokens`` [M] at hidden ``rows`` [M]."""
        if entropy not in ENTROPY_MODES:
            raise ValueError(f"entropy={entropy!r}: use one of {ENTROPY_MODES}")
        self._request = HeadRequest(rows, tokens, temperature, entropy, chunk_rows)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return nn.functional.linear(hidden, self.weight)
        if self._math is None:
            self._math = default_chunk_math(hidden.device)
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
        chunk_rows: rows per chunk; default ``math.chunk_elements // V``.
        math: the per-chunk math (default :data:`EAGER`; :func:`fused_chunk_math` compiles it).
    Returns:
        [M, 2] float32 (float64 for float64 inputs): log-probs and entropies, differentiable w.r.t. hidden
        and weight.
    """
    math = math or EAGER
    rows = chunk_rows or max(1, math.chunk_elements // weight.shape[0])
    return _LinearLogprobs.apply(hidden, weight, tokens, temperature, entropy, rows, math)


class ChunkMath(NamedTuple):
    """The per-chunk elementwise math of :func:`linear_logprobs` (eager, or compiled into fewer passes)."""

    stats: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    grad: Callable[..., torch.Tensor]
    chunk_elements: int = CHUNK_ELEMENTS
    """Logit entries per chunk by default."""
    name: str = "eager"


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


def fused_chunk_math() -> ChunkMath:
    """:data:`EAGER` under torch.compile (default mode: inductor fuses each function's elementwise passes into a
    few kernels; the matmuls stay outside), falling back to eager where compiling fails."""
    return ChunkMath(_Compiled(_chunk_stats), _Compiled(_chunk_grad), FUSED_CHUNK_ELEMENTS, "fused")


def default_chunk_math(device: torch.device) -> ChunkMath:
    """The fused math on a GPU, the eager one elsewhere (compiling costs more there than it saves)."""
    return fused_chunk_math() if device.type == "cuda" else EAGER


class _Compiled:
    """``torch.compile(fn)``, or ``fn`` itself from the first compile failure on (logged once, with its cause)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.compiled = fn, torch.compile(fn)
        self.failure: str | None = None

    def __call__(self, *args: Any) -> Any:
        if self.failure is None:
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as err:  # inductor's errors derive from it too
                self.failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                logger.warning("the fused LM head's %s did not compile (%s); it runs eagerly", self.fn.__name__,
                               self.failure)
        return self.fn(*args)


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
                torch.mm(dz, weight, out=grad_hidden[chunk])
            if ctx.needs_input_grad[1]:
                grad_weight += dz.t() @ h
        grad_w = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w, None, None, None, None, None
