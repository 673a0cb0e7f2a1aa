"""Per-token log-probs of given responses under a causal LM (the trainer's side of rollout parity)."""

from __future__ import annotations

import torch


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
    return token_logprobs(logits, input_ids[:, -response_width:], temperature)
