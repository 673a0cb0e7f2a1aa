"""Per-token log-probs of given responses under a causal LM (the trainer's side of rollout parity)."""

from __future__ import annotations

import torch

from rlkit.algos.losses import entropy_from_logits
from rlkit.models.head import response_head
from rlkit.models.packing import pack_rows, response_slots

CHUNK_ELEMENTS = 1 << 27
"""Logit entries per fp32 chunk in :func:`sampled_logprobs` (512 MiB): rows = CHUNK_ELEMENTS // V."""


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] positions counting real tokens only, so left padding does not shift them (as generate does)."""
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.clamp(min=0)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at ``tokens``. Shapes: [B, T, V], [B, T] -> [B, T] float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def response_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int
) -> torch.Tensor:
    """[B, T, V] logits that predict the last ``response_width`` tokens of each row (model dtype), padded rows.

    Args:
        input_ids: [B, P + T] prompt (left-padded) then response (right-padded).
        attention_mask: [B, P + T].
        response_width: T.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_for(attention_mask),
        logits_to_keep=response_width + 1,  # the LM head runs on the response positions only
        use_cache=False,
    )
    return out.logits[:, :-1]


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_width: int,
    temperature: float,
    padding_free: bool = False,
    entropy: str = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the last ``response_width`` tokens of each row under ``model``.

    The actor's forward for the loss (call under grad) and for scoring (under no_grad). With a
    :class:`~rlkit.models.head.ResponseHead` (see :func:`~rlkit.models.head.install_response_head`) the
    LM head and log-softmax run fused, on the real response tokens only; ``padding_free`` then packs the
    rows into one (see :mod:`rlkit.models.packing`). Other models take the plain path: padded rows,
    [B, T, V] logits, chunked log-softmax.

    Args:
        input_ids: [B, P + T] prompt (left-padded) then response (right-padded).
        attention_mask: [B, P + T], 1 on real tokens; the response mask is its last T columns.
        response_width: T.
        temperature: the sampling temperature the rollout used.
        padding_free: pack the rows (needs a ResponseHead model of a family in PACKABLE_MODEL_TYPES).
        entropy: "none" (None returned), "detached" (a metric) or "grad" (for an entropy bonus).
    Returns:
        [B, T] float32 log-probs and [B, T] float32 entropies or None; 0 at padded response positions.
    """
    head = response_head(model)
    if head is None:
        if padding_free:
            raise ValueError(
                f"padding_free=True needs the fused response head: {type(model).__name__} has none "
                "(install_response_head accepts the families of rlkit.models.packing.PACKABLE_MODEL_TYPES); "
                "set padding_free=False"
            )
        return _plain_logprobs(model, input_ids, attention_mask, response_width, temperature, entropy)
    mask = attention_mask.to("cpu")
    packed = pack_rows(input_ids, mask) if padding_free else None
    slots = response_slots(input_ids, mask, response_width, packed)
    with head.scoring(slots.rows, slots.tokens, temperature, entropy):
        out = model(**(packed.model_kwargs() if packed else _padded_kwargs(input_ids, attention_mask))).logits
    entropies = None if entropy == "none" else slots.scatter(out[:, 1] if entropy == "grad" else out[:, 1].detach())
    return slots.scatter(out[:, 0]), entropies


def _padded_kwargs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, object]:
    """A transformers forward over padded rows, all positions kept (the head picks the response's rows)."""
    position_ids = position_ids_for(attention_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}


def _plain_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_logprobs` for models without a ResponseHead: [B, T, V] logits, then the log-softmax."""
    logits = response_logits(model, input_ids, attention_mask, response_width)
    tokens = input_ids[:, -response_width:]
    mask = attention_mask[:, -response_width:].bool()
    if entropy == "grad":  # the bonus needs the entropy's gradient: plain autograd over fp32 logits
        scaled = logits.float() / temperature
        logprobs, entropies = token_logprobs(scaled, tokens, 1.0), entropy_from_logits(scaled)
    else:
        logprobs, entropies = sampled_logprobs(logits, tokens, temperature)
    logprobs = logprobs.masked_fill(~mask, 0.0)
    return logprobs, None if entropy == "none" else entropies.masked_fill(~mask, 0.0)


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``tokens`` under softmax(logits / temperature), with gradient, and the entropy, without.

    The training loss's path: it upcasts ``chunk_rows`` rows at a time and saves only the logits (in
    their own dtype) and one fp32 log-sum-exp per row for backward, where :func:`token_logprobs`
    materialises and keeps fp32 copies of the whole [B, T, V] tensor.

    Args:
        logits: [B, T, V] any float dtype (e.g. bf16 from the LM head).
        tokens: [B, T] int64.
        chunk_rows: B*T rows per fp32 chunk; default CHUNK_ELEMENTS // V.
    Returns:
        [B, T] float32 log-probs (differentiable w.r.t. logits) and [B, T] float32 entropies (detached).
    """
    vocab = logits.shape[-1]
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    logprobs, entropy = _SampledLogprobs.apply(logits.reshape(-1, vocab), tokens.reshape(-1), temperature, rows)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)


class _SampledLogprobs(torch.autograd.Function):
    """Row-chunked log-softmax at one index per row; backward recomputes softmax from the saved logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int):
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for s in range(0, n, rows):
            x = _scaled(logits[s : s + rows], temperature)
            norm = torch.logsumexp(x, dim=-1)
            lse[s : s + rows] = norm
            logprobs[s : s + rows] = x.gather(-1, tokens[s : s + rows, None]).squeeze(-1) - norm
            probs = (x - norm[:, None]).exp_()
            entropy[s : s + rows] = norm - (probs * x).sum(-1)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            g = grad_logprobs[s : s + rows, None]
            # d logp[token] / d logit = (onehot(token) - softmax) / t
            d = _scaled(logits[s : s + rows], t).sub_(lse[s : s + rows, None]).exp_().mul_(-g)
            d.scatter_add_(-1, tokens[s : s + rows, None], g)
            grad[s : s + rows] = d.div_(t)
        return grad, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of ``logits / temperature`` (never the caller's tensor, even when it is fp32)."""
    return logits.to(torch.float32, copy=True).div_(temperature)
