"""Rollout with Hugging Face generate on an unsharded copy of the actor."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch

from rlkit.rollout.base import LOGIT_SETTINGS, Generation, SamplingParams
from rlkit.rollout.stops import StopSequences


class HFEngine:
    """Batched sampling with the KV cache; the model is a plain (unsharded) module on this rank's device.

    Each rank owns a whole copy, so ranks generate independently (no collectives,
    any number of decoding steps) and receive the actor's weights through
    :meth:`load_weights` after every update. Log-probs are taken step by step from
    the scores generate samples from, so memory stays at one [N*n, V] step, not
    the whole [N*n, T, V] of logits; they cost next to nothing here, so every row
    has them (``rollout.engine_logprobs`` is vLLM's).

    Sampling follows rlkit's SamplingParams only: the model directory's ``generation_config.json`` is
    replaced by transformers' defaults, so a shipped ``repetition_penalty`` (or any other logits
    processor) cannot apply at sampling while the trainer's log-probs ignore it (vLLM's engine is built
    with ``generation_config="vllm"`` for the same reason).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int, tokenizer: Any = None):
        """``tokenizer``: the model's, for stop strings (:attr:`SamplingParams.stops`)."""
        from transformers import GenerationConfig

        self.tokenizer = tokenizer
        model.eval().requires_grad_(False)
        self.model: Any = cast(Any, model)  # a transformers model: generate() is typed loosely
        self.model.generation_config = GenerationConfig()  # generate() fills unset settings from this one
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        torch.manual_seed(params.seed)
        recorder = _SampledLogprobs(params.temperature, params.top_p)
        sequences = self.model.generate(
            input_ids=prompt_ids.repeat_interleave(params.n, dim=0),  # what num_return_sequences does, greedy too
            attention_mask=prompt_mask.repeat_interleave(params.n, dim=0),
            generation_config=self._generation_config(params),
            logits_processor=[recorder],
            stopping_criteria=self._stopping(params.stops),
        )
        response = sequences[:, prompt_ids.shape[1] :]
        logprobs = recorder.result(response)
        mask, finished = _response_mask(response, self.eos_token_id if params.stop_at_eos else None)
        width = params.max_new_tokens
        return Generation(
            response_ids=_pad_to(response.masked_fill(mask == 0, self.pad_token_id), width, self.pad_token_id).long(),
            response_mask=_pad_to(mask, width, 0),
            logprobs=_pad_to(logprobs.masked_fill(mask == 0, 0.0), width, 0),
            logprob_rows=torch.ones(len(response), dtype=torch.bool, device=response.device),
            finish_reason=["stop" if f else "length" for f in finished.tolist()],
        )

    def _stopping(self, stops: StopSequences) -> list[Any]:
        """transformers' stopping criteria for ``stops``: a row ends once its last token is a stop token or its text
        ends a stop string; generate stops when every row ended (end-of-text included)."""
        from transformers import StopStringCriteria

        criteria: list[Any] = [_StopTokens(stops.tokens)] if stops.tokens else []
        if stops.strings:
            if self.tokenizer is None:
                raise ValueError(f"stop strings {list(stops.strings)}: this hf engine has no tokenizer to match them")
            criteria.append(StopStringCriteria(self.tokenizer, list(stops.strings)))
        return criteria

    def effective_sampling(self, params: SamplingParams) -> dict[str, object]:
        """The settings of :data:`~rlkit.rollout.base.LOGIT_SETTINGS` generate applies for ``params``: rlkit's
        GenerationConfig with what transformers fills in from the model's ``generation_config`` and its defaults."""
        merged, _ = self.model._prepare_generation_config(self._generation_config(params))
        return {k: getattr(merged, k, None) for k in LOGIT_SETTINGS}

    def _generation_config(self, params: SamplingParams) -> Any:
        """transformers' GenerationConfig for ``params``: temperature and top_p (top_k off), nothing else."""
        from transformers import GenerationConfig

        greedy = params.temperature == 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        return GenerationConfig(
            do_sample=not greedy,
            **sampling,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            eos_token_id=self.eos_token_id if params.stop_at_eos else None,
            pad_token_id=self.pad_token_id,
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        for name, tensor in weights:
            self.model.get_parameter(name).copy_(tensor)
            count += 1
        return count

    def sleep(self) -> None:
        """Nothing to release: the copy stays resident (it is what generate and load_weights use)."""

    def weights_awake(self) -> AbstractContextManager[None]:
        """Nothing to wake: the weights are always readable."""
        return nullcontext()

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""


class _StopTokens:
    """A stopping criterion: the rows whose last token is one of ``tokens``."""

    def __init__(self, tokens: frozenset[int]):
        self._tokens = torch.tensor(sorted(tokens))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """input_ids: [B, L] so far -> [B] bool, True where the row ended."""
        return torch.isin(input_ids[:, -1], self._tokens.to(input_ids.device))


class _SampledLogprobs:
    """A logits processor that keeps each step's log-softmax of the distribution sampled from (scores / temperature,
    nucleus-masked as generate's warpers do after it) until the next step reveals the token chosen."""

    def __init__(self, temperature: float, top_p: float):
        from transformers import TopPLogitsWarper

        self._temperature = temperature or 1.0
        self._nucleus = TopPLogitsWarper(top_p) if temperature and top_p < 1 else None
        self._last: torch.Tensor | None = None
        self._picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, L] so far; scores: [B, V] for the next token. Returns scores unchanged."""
        if self._last is not None:
            self._picked.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        scaled = scores.float() / self._temperature
        if self._nucleus is not None:
            scaled = self._nucleus(input_ids, scaled)
        self._last = torch.log_softmax(scaled, dim=-1)
        return scores

    def result(self, response: torch.Tensor) -> torch.Tensor:
        """[B, t] log-probs of the generated ``response`` [B, t] (the last step gathered here)."""
        if self._last is None:
            raise RuntimeError("generate produced no step: nothing to take log-probs from")
        picked = self._picked + [self._last.gather(1, response[:, -1:]).squeeze(1)]
        return torch.stack(picked, dim=1)


def _response_mask(response: torch.Tensor, eos_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, t] ids -> ([N, t] float mask through the first end-of-text, [N] bool whether it was emitted); None: no
    token ends a completion."""
    is_eos = response == eos_token_id if eos_token_id is not None else torch.zeros_like(response, dtype=torch.bool)
    finished = is_eos.any(dim=1)
    first = torch.where(finished, is_eos.float().argmax(dim=1), response.shape[1])
    positions = torch.arange(response.shape[1], device=response.device)
    return (positions.unsqueeze(0) <= first.unsqueeze(1)).float(), finished


def _pad_to(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Right-pad dim 1 of [N, t] to [N, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
