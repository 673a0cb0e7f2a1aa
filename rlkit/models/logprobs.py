"""Per-token log-probs of given responses under a causal LM (the trainer's side of rollout parity)."""

from __future__ import annotations

import torch

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
    """[B, T, V] logits that predict the last ``response_width`` tokens of each row (model dtype).

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
    )
    return out.logits[:, :-1]


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the last ``response_width`` tokens of each row.

    Args:
        input_ids: [B, P + T] prompt (left-padded) then response (right-padded).
        attention_mask: [B, P + T].
        response_width: T.
        temperature: the sampling temperature the rollout used.

    Returns:
        [B, T] float32; positions past a response's end hold garbage and must be masked.
    """
    logits = response_logits(model, input_ids, attention_mask, response_width)
    return sampled_logprobs(logits, input_ids[:, -response_width:], temperature)[0]


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
