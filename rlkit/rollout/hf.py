"""Rollout with Hugging Face generate on an unsharded copy of the actor."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlkit.models.logprobs import token_logprobs
from rlkit.rollout.base import Generation, SamplingParams


class HFEngine:
    """Batched sampling with the KV cache; the model is a plain (unsharded) module on this rank's device.

    Each rank owns a whole copy, so ranks generate independently (no collectives,
    any number of decoding steps) and receive the actor's weights through
    :meth:`load_weights` after every update.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int):
        self.model = model.eval().requires_grad_(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        torch.manual_seed(params.seed)
        out = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            num_return_sequences=params.n,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        response = out.sequences[:, prompt_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1)
        logprobs = token_logprobs(logits, response, params.temperature)
        mask, finished = _response_mask(response, self.eos_token_id)
        width = params.max_new_tokens
        return Generation(
            response_ids=_pad_to(response.masked_fill(mask == 0, self.pad_token_id), width, self.pad_token_id).long(),
            response_mask=_pad_to(mask, width, 0),
            logprobs=_pad_to(logprobs * mask, width, 0),
            finish_reason=["stop" if f else "length" for f in finished.tolist()],
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        for name, tensor in weights:
            self.model.get_parameter(name).copy_(tensor)
            count += 1
        return count


def _response_mask(response: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, t] ids -> ([N, t] float mask through the first end-of-text, [N] bool whether it was emitted)."""
    is_eos = response == eos_token_id
    finished = is_eos.any(dim=1)
    first = torch.where(finished, is_eos.float().argmax(dim=1), response.shape[1])
    positions = torch.arange(response.shape[1], device=response.device)
    return (positions.unsqueeze(0) <= first.unsqueeze(1)).float(), finished


def _pad_to(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Right-pad dim 1 of [N, t] to [N, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
