"""What every rollout engine provides."""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from rlkit.rollout.stops import StopSequences

LOGIT_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "no_repeat_ngram_size")  # fmt: skip
"""Sampling settings that change the distribution sampled from (and so an engine's log-probs)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int
    """Completions per prompt."""
    max_new_tokens: int
    """T, the response width every engine pads to."""
    min_new_tokens: int = 0
    """End-of-text is not sampled before this many tokens."""
    temperature: float
    """Sampling temperature; 0 means greedy (log-probs are then those of the unscaled distribution)."""
    top_p: float
    seed: int
    """Seeds this call's sampling (same seed, same completions on the same engine)."""
    logprob_rows: tuple[bool, ...] | None = None
    """[N] which prompts' completions carry the engine's log-probs, where the caller picks them (a multi-turn
    rollout keeps whole trajectories); ``()``: none, for a caller that keeps none (vLLM then gathers no
    log-prob of the batch at any step and hands back no per-token values); None: the engine's own pick (vLLM:
    ``logprob_fraction`` of the prompts). Engines that always return them (HF generate) ignore it."""
    stop_at_eos: bool = True
    """End-of-text ends a completion; False: only ``max_new_tokens`` does (Tinker's ``stop=[]``), and an
    end-of-text token sampled on the way is an ordinary token of the completion."""
    stops: StopSequences = StopSequences()
    """Where a completion ends besides end-of-text (Tinker's ``stop``): the hf engine stops sampling a row at its
    first stop and the whole call once every row ended; the caller cuts each row after its stop
    (:meth:`StopSequences.cut`: an engine may hand back tokens past it, as vLLM's does)."""


@dataclass(kw_only=True)
class Generation:
    """Completions for N prompts x n samples, prompt-major (all samples of prompt 0 first)."""

    response_ids: torch.Tensor
    """[N*n, T] int64, padded after the end with the pad id."""
    response_mask: torch.Tensor
    """[N*n, T] float32, 1 on generated tokens up to and including the end-of-text token."""
    logprobs: torch.Tensor
    """[N*n, T] float32 log-probs of the sampled tokens under the distribution sampled from:
    log softmax(logits / temperature), renormalised over the nucleus when top_p < 1; 0 past the end;
    NaN on every position of a row the engine returned none for (see ``logprob_rows``)."""
    logprob_rows: torch.Tensor
    """[N*n] bool, True where ``logprobs`` holds the engine's log-probs (whole groups: all n samples of a prompt)."""
    finish_reason: list[str]
    """"stop" where end-of-text was emitted, "length" where max_new_tokens ran out."""

    def to(self, device: torch.device) -> Generation:
        """The same completions with every tensor on ``device``."""
        return Generation(
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            logprobs=self.logprobs.to(device),
            logprob_rows=self.logprob_rows.to(device),
            finish_reason=self.finish_reason,
        )


class RolloutEngine(Protocol):
    """A generator on this rank: its own whole copy of the policy on this rank's device, or (tensor parallelism,
    :class:`~rlkit.rollout.tp_group.TPGroupEngine`) this rank's way into the engine its group shares."""

    name: str

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        """prompt_ids, prompt_mask: [N, P] left-padded."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full (unsharded) tensors in by parameter name, consuming the iterator once, in order;
        returns how many were loaded. Wakes a sleeping engine."""
        ...

    def sleep(self) -> None:
        """Release device memory (weights, KV cache) until the next load_weights or generate, where supported."""
        ...

    def weights_awake(self) -> AbstractContextManager[None]:
        """The engine's weights readable in this block (a sleeping engine's woken), and the engine left as it was
        found (asleep again if it slept): what every diagnostic that reads the engine's weights holds."""
        ...

    def close(self) -> None:
        """Free the engine and any processes it started; idempotent."""
        ...


def logprob_prompts(prompts: int, fraction: float) -> torch.Tensor:
    """[prompts] bool: which prompts' completions carry engine log-probs, ``ceil(fraction * prompts)`` of them
    evenly spaced from the first (at least one when ``fraction`` > 0, none when it is 0)."""
    chosen = torch.zeros(prompts, dtype=torch.bool)
    count = min(prompts, math.ceil(round(fraction * prompts, 6)))  # 0.1 * 30 is 3, not 3.0000000000000004
    if count:
        chosen[torch.arange(count) * prompts // count] = True
    return chosen
