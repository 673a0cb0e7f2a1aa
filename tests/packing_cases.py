"""Rows of very different lengths and the plain padded reference, shared by the packing tests (and workers)."""

from __future__ import annotations

import torch

from rlkit.algos import entropy_from_logits
from rlkit.models.logprobs import response_logits, token_logprobs

PROMPT, WIDTH = 20, 30
LENGTHS = [(2, 1), (20, 30), (7, 12), (13, 5)]
"""(prompt, response) lengths of the rows: 1- and 30-token responses, 2- and 20-token prompts."""
TEMPERATURE = 0.7


def rows(vocab: int, lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, PROMPT + WIDTH] ids and attention mask: prompts left-padded, responses right-padded (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), PROMPT + WIDTH), generator=gen)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(lengths):
        mask[i, PROMPT - p : PROMPT + r] = 1
    return ids.masked_fill(mask == 0, 0), mask


def reference_logprobs(model, ids, mask, temperature: float = TEMPERATURE):
    """The plain path: padded rows, [b, T, V] fp32 logits, log-softmax and entropy, 0 at padding."""
    logits = response_logits(model, ids, mask, WIDTH).float() / temperature
    on = mask[:, -WIDTH:].bool()
    logprobs = token_logprobs(logits, ids[:, -WIDTH:], 1.0).masked_fill(~on, 0.0)
    return logprobs, entropy_from_logits(logits).masked_fill(~on, 0.0)


def weighted_loss(
    logprobs: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor, rows: slice = slice(None)
) -> torch.Tensor:
    """A loss weighing every response token differently (so a token moved or dropped changes it), over
    the batch's ``rows`` and normalised by the whole batch's response tokens (so ranks' losses add up)."""
    on = mask[:, -WIDTH:].float()
    weights = (torch.linspace(-1.0, 2.0, on.numel(), device=on.device).view_as(on) * on) / on.sum()
    loss = (weights[rows] * logprobs).sum()
    return loss if entropy is None else loss - 0.3 * (weights[rows] * entropy).sum()
