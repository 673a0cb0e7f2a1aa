"""Runs on every rank: the rollout's tokens re-scored under hypotheses about why engine and trainer disagree.

Each hypothesis is a way the engine's distribution can differ from the trainer's at the same weights (a
setting that transforms the logits before sampling, or a lower precision). If the trainer's log-probs,
transformed the same way, reproduce the engine's, that hypothesis explains the gap
(:mod:`rlkit.diagnostics.mismatch` decides). The hypotheses, all from the trainer's fp32 logits z:

- ``no_temperature``: log softmax(z), the engine's log-probs taken before the temperature (TRL #4159);
- ``nucleus``: log softmax(z / T) renormalised over the top-p nucleus (TRL #6789: the engine's "processed"
  log-probs at top_p < 1 are log(p / kept mass));
- ``no_early_eos``: end-of-text suppressed before ``min_new_tokens`` (the engine's log-probs are then
  renormalised without it);
- ``penalised[p]``: a repetition penalty p on every token already in the prompt or the response so far
  (logit / p if positive, * p if negative, then / T: Hugging Face's and vLLM's rule), for each p of a grid
  (a model's generation_config or a sampling default: OpenPipe/ART #140, NeMo-RL #3497, verl #7270);
- ``engine_dtype``: the trainer's forward under autocast to the engine's lower precision (the bf16 floor).

And the weights themselves: a float64 sum and sum of squares per tensor, on the trainer (cast to the engine's
dtype) and inside the engine, to catch a weight sync that did not take.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rlkit.models.logprobs import response_logits

PENALTY_GRID = (0.8, 0.9, 0.95, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0)
"""Repetition penalties tried by the ``penalised`` hypothesis (1 is the trainer itself)."""
PROBE_ROWS = 4
"""Rows per re-scoring forward: the probe holds their [rows, T, V] fp32 logits (plus one [T, V] row at a time)."""


@dataclass
class Rescored:
    """One rank's rows re-scored ([n, T] float32 log-probs of the sampled tokens, 0 past each response)."""

    trainer: torch.Tensor
    """Under the actor's current weights, at the rollout's temperature: what the trainer believes."""
    no_temperature: torch.Tensor | None = None
    """The same at temperature 1 (only when the rollout's temperature is not 1)."""
    nucleus: torch.Tensor | None = None
    """Renormalised over the top-p nucleus (only when top_p < 1)."""
    no_early_eos: torch.Tensor | None = None
    """End-of-text suppressed before min_new_tokens (only when min_new_tokens > 0)."""
    penalised: dict[float, torch.Tensor] = field(default_factory=dict)
    """Under each repetition penalty of :data:`PENALTY_GRID`."""
    engine_dtype: torch.Tensor | None = None
    """The trainer's forward under autocast to the engine's dtype (only when that is lower than the trainer's)."""
    engine_fp32: torch.Tensor | None = None
    """The engine's own weights, upcast to fp32 (engines whose model rlkit holds: the hf engine)."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """The trainer's compute dtype and the engine's weight dtype."""
    checksums: list[tuple[str, float, float, float, float]] = field(default_factory=list)
    """(engine tensor, trainer sum, trainer sum of squares, engine sum, engine sum of squares) per readable tensor."""
    unreadable: int = 0
    """Engine tensors whose values the probe could not read (vLLM's CPU backend repacks its linear weights)."""
    optimizer_steps: int = 0
    """The actor's optimizer steps so far."""
    engine_synced_at: int = 0
    """The optimizer step whose weights the engine last received (less than optimizer_steps: a sync is missing)."""
    sampling: dict[str, object] = field(default_factory=dict)
    """The engine's effective sampling settings that transform the logits (as far as rlkit can read them)."""


def rescore_rows(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    width: int,
    temperature: float,
    top_p: float,
    min_new_tokens: int = 0,
    eos_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """Rows [b, P + T] re-scored by ``model`` under the hypotheses of the module doc (one forward, no grad).

    Returns {"trainer", "no_temperature" (T != 1), "nucleus" (top_p < 1), "no_early_eos" (min_new_tokens > 0),
    "penalty=<p>" for each p}: [b, T] each.
    """
    logits = response_logits(model, input_ids, attention_mask, width).float()
    tokens = input_ids[:, -width:]
    mask = attention_mask[:, -width:].bool()
    t = temperature or 1.0
    out = {"trainer": _picked(logits / t, tokens)}
    if t != 1.0:
        out["no_temperature"] = _picked(logits, tokens)
    if top_p < 1.0:
        out["nucleus"] = _picked(nucleus_logits(logits / t, top_p), tokens)
    if min_new_tokens > 0 and eos_token_id is not None:
        early = logits.clone()
        early[:, :min_new_tokens, eos_token_id] = -torch.inf
        out["no_early_eos"] = _picked(early / t, tokens)
    for row in range(len(input_ids)):
        seen = seen_tokens(input_ids[row], attention_mask[row], width, logits.shape[-1])
        for p in PENALTY_GRID:
            key = f"penalty={p}"
            out.setdefault(key, torch.zeros_like(out["trainer"]))
            out[key][row] = _picked(penalised_logits(logits[row], seen, p) / t, tokens[row])
    return {name: value.masked_fill(~mask, 0.0) for name, value in out.items()}


def seen_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
    """[T, V] bool: whether each token id occurs before each response position (in the prompt or the response so
    far), from one row's [P + T] ids and mask."""
    prompt = input_ids[:-width][attention_mask[:-width].bool()]
    seen = torch.zeros(width, vocab, dtype=torch.bool, device=input_ids.device)
    seen[:, prompt] = True
    response = input_ids[-width:]
    for t in range(1, width):
        seen[t:, response[t - 1]] = True
    return seen


def penalised_logits(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty's rule (Keskar et al. 2019; Hugging Face's and vLLM's): logits of ``seen`` tokens
    divided by ``penalty`` where positive, multiplied where negative. Shapes: [..., V] each."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def nucleus_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] logits outside the smallest set of tokens holding ``top_p`` of the mass set to -inf (the top token
    always stays), as Hugging Face's TopPLogitsWarper and vLLM's sampler keep them."""
    ordered, order = logits.sort(dim=-1, descending=False)
    tail = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    tail[..., -1] = False
    return logits.masked_fill(tail.scatter(-1, order, tail), -torch.inf)


def _picked(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def tensor_sums(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """{name: (sum, sum of squares)} in float64 of each tensor cast to ``dtype`` (the engine's, so a correct sync
    agrees up to summation order)."""
    sums = {}
    for name, tensor in weights:
        values = tensor.detach().to(dtype).double()
        sums[name] = (float(values.sum()), float(values.square().sum()))
    return sums


def engine_tensor_sums(engine: object, shapes: dict[str, list[int]]) -> tuple[dict[str, tuple], int]:
    """The engine's own tensors' sums: ({engine tensor: (sum, sum of squares, [trainer tensors it holds])},
    unreadable count), or ({}, -1) for an engine whose weights the probe cannot reach (tensor parallel)."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):  # the hf engine: the same names as the trainer's
        named = [(n, p) for n, p in model.named_parameters() if n in shapes]
        return {n: (*s, [n]) for n, s in tensor_sums(named, named[0][1].dtype).items()}, 0
    llm = getattr(engine, "llm", None)
    if llm is None or getattr(llm, "llm_engine", None) is None:
        return {}, -1
    results = llm.collective_rpc("rlkit_tensor_sums", args=(shapes,))
    return (results[0][0], results[0][1]) if len(results) == 1 else ({}, -1)
