"""Runs on every rank: the rollout's tokens re-scored under hypotheses about why engine and trainer disagree.

Each hypothesis is a way the engine's distribution can differ from the trainer's at the same weights (a
setting that transforms the logits before sampling, or a lower precision). If the trainer's log-probs,
transformed the same way, reproduce the engine's, that hypothesis explains the gap
(:mod:`rlkit.diagnostics.mismatch` decides). The hypotheses, all from the trainer's fp32 logits z:

- ``temperatures[t]``: log softmax(z / t) for each t of a grid, and the configured T applied twice (T²): an engine
  whose effective temperature is not the configured one (set on one side only, TRL #4159; the engine's log-probs
  taken before the temperature, t = 1; a logits processor or sampler default that scales again);
- ``nucleus``: log softmax(z / T) renormalised over the top-p nucleus (TRL #6789: the engine's "processed"
  log-probs at top_p < 1 are log(p / kept mass));
- ``top_k[k]``: the same over the k most likely tokens, for each k of a grid (a top-k the engine applies and rlkit
  did not set: a model's generation_config, a sampler default, a logits processor);
- ``no_early_eos``: end-of-text suppressed before ``min_new_tokens`` (the engine's log-probs are then
  renormalised without it);
- ``penalised[p]``: a repetition penalty p on every token already in the prompt or the response so far
  (logit / p if positive, * p if negative, then / T: Hugging Face's and vLLM's rule), for each p of a grid
  (a model's generation_config or a sampling default: OpenPipe/ART #140, NeMo-RL #3497, verl #7270);

The floor the gap is held against (:mod:`rlkit.diagnostics.floor` decides) is a reference forward of the
trainer's own weights in the engine's arithmetic (:mod:`rlkit.workers.mismatch` builds it). And the weights
themselves: fingerprints that see order (:mod:`rlkit.models.fingerprint`) of every tensor, on the trainer (cast to
the engine's dtype) and inside the engine, to catch a weight sync that did not take or loaded parts out of order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlkit.models.fingerprint import fingerprint
from rlkit.models.logprobs import response_logits

PENALTY_GRID = (0.8, 0.9, 0.95, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0)
"""Repetition penalties tried by the ``penalised`` hypothesis (1 is the trainer itself)."""
TOP_K_GRID = (1, 2, 4, 8, 16, 20, 32, 40, 50, 64, 100, 128)
"""Top-k values tried by the ``top_k`` hypothesis (common sampler defaults and powers of two)."""
TEMPERATURE_GRID = (0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
"""Effective temperatures tried by the ``temperatures`` hypothesis, with the configured one squared (applied twice);
the configured one itself is the trainer."""
UNSAMPLEABLE = -100.0
"""The log-prob a truncation hypothesis gives a token it excludes (the engine sampled it: a gap that refutes it)."""
PROBE_ROWS = 4
"""Rows per re-scoring forward: the probe holds their [rows, T, V] fp32 logits (plus one [T, V] row at a time)."""


@dataclass
class Rescored:
    """One rank's rows re-scored ([n, T] float32 log-probs of the sampled tokens, 0 past each response)."""

    trainer: torch.Tensor
    """Under the actor's current weights, at the rollout's temperature: what the trainer believes."""
    temperatures: dict[float, torch.Tensor] = field(default_factory=dict)
    """The same at each other effective temperature of :func:`effective_temperatures`."""
    temperature: float = 1.0
    """The rollout's configured temperature (what ``trainer`` scores at)."""
    nucleus: torch.Tensor | None = None
    """Renormalised over the top-p nucleus (only when top_p < 1)."""
    top_k: dict[int, torch.Tensor] = field(default_factory=dict)
    """Renormalised over the k most likely tokens, for each k of :data:`TOP_K_GRID`."""
    no_early_eos: torch.Tensor | None = None
    """End-of-text suppressed before min_new_tokens (only when min_new_tokens > 0)."""
    penalised: dict[float, torch.Tensor] = field(default_factory=dict)
    """Under each repetition penalty of :data:`PENALTY_GRID`."""
    reference: torch.Tensor | None = None
    """The floor's reference: the trainer's weights in the engine's arithmetic (see ``reference_kind``)."""
    floor_minimum: float = 0.0
    """The least floor (nats per token) where ``reference`` cannot be a second implementation of the engine's
    arithmetic (rlkit.diagnostics.floor.DTYPE_FLOORS); 0 otherwise."""
    reference_kind: str = ""
    """How the reference was computed (a copy of the engine's model holding the trainer's weights, or the
    trainer's own forward in another layout, under autocast to the engine's dtype where that is lower)."""
    rank: int = 0
    dtypes: dict[str, str] = field(default_factory=dict)
    """The trainer's compute dtype and the engine's weight dtype."""
    fingerprints: list[tuple[str, float]] = field(default_factory=list)
    """(engine tensor, relative difference of its fingerprint from the trainer's) per readable engine tensor
    (rlkit.models.fingerprint.differs: 0 when equal, above TOLERANCE when the values or their order differ)."""
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

    Returns {"trainer", "temperature=<t>" for each t of :func:`effective_temperatures`, "nucleus" (top_p < 1),
    "no_early_eos" (min_new_tokens > 0), "top_k=<k>" for each k < V, "penalty=<p>" for each p}: [b, T] each.
    """
    logits = response_logits(model, input_ids, attention_mask, width).float()
    tokens = input_ids[:, -width:]
    mask = attention_mask[:, -width:].bool()
    t = temperature or 1.0
    out = {"trainer": _picked(logits / t, tokens)}
    for other in effective_temperatures(t):
        out[f"temperature={other!r}"] = _picked(logits / other, tokens)
    if top_p < 1.0:
        out["nucleus"] = _picked(nucleus_logits(logits / t, top_p), tokens).clamp(min=UNSAMPLEABLE)
    for k in (k for k in TOP_K_GRID if k < logits.shape[-1]):
        out[f"top_k={k}"] = _picked(top_k_logits(logits / t, k), tokens).clamp(min=UNSAMPLEABLE)
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


def effective_temperatures(configured: float) -> list[float]:
    """The temperatures an engine may sample at instead of ``configured`` (its greedy 0 scores at 1): those of
    :data:`TEMPERATURE_GRID` and ``configured`` applied twice, ``configured`` itself left out."""
    t = configured or 1.0
    return sorted(set(TEMPERATURE_GRID) - {t} | ({round(t * t, 6)} - {t}))


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


def top_k_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., V] logits outside the ``k`` largest set to -inf (ties at the k-th kept, as samplers keep them)."""
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -torch.inf)


def _picked(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def engine_fingerprints(engine: object, shapes: dict[str, list[int]]) -> tuple[dict[str, tuple], int]:
    """The engine's own fingerprints (rlkit.models.fingerprint) of the rows holding each trainer tensor:
    ({trainer tensor: (engine tensor, fingerprint)}, unreadable count), or ({}, -1) for an engine whose weights the
    probe cannot reach (tensor parallel)."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):  # the hf engine: the same names as the trainer's
        return {n: (n, fingerprint(p)) for n, p in model.named_parameters() if n in shapes}, 0
    llm = getattr(engine, "llm", None)
    if llm is None or getattr(llm, "llm_engine", None) is None:
        return {}, -1
    results = llm.collective_rpc("rlkit_fingerprints", args=(shapes,))
    return (results[0][0], results[0][1]) if len(results) == 1 else ({}, -1)
