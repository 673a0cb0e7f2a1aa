"""Why the rollout engine and the trainer disagree: per-token gaps, grouped, and checks that name causes (plain data).

:func:`mismatch_report` joins a rollout (a :class:`~rlkit.data.batch.Batch` nothing has trained on yet) with each
rank's :class:`~rlkit.diagnostics.rescore.Rescored` and returns a :class:`MismatchReport`. Each check compares
the observed gap, mean |delta| over the tokens with an engine log-prob (delta = trainer - engine), against what a
hypothesis leaves of it:

- "sampling: temperature", "sampling: top_p/top_k", "sampling: min_new_tokens", "sampling: repetition_penalty":
  the trainer's logits transformed as the engine would (see rlkit.diagnostics.rescore) reproduce the engine's
  log-probs: named when that removes at least half of a gap above :data:`NOISE`, or when the engine's own settings
  show a top-k, min-p or penalty (which can change the samples without showing in its log-probs);
- "stale weights": a float64 sum and sum of squares of each engine tensor differs from the trainer's (cast to the
  engine's dtype), or the engine last received an older optimizer step's weights than the actor holds;
- "dtype floor": the engine computes in a lower precision than the trainer, and the gap is within 3x the trainer's
  own floor (its log-probs under autocast to the engine's dtype against its own); the hf engine's weights
  re-scored in fp32 show how much of it is the weights' rounding and how much the lower-precision kernels;
- "tokenisation": multi-turn rollouts whose re-rendered conversation drifted from the engine's ids (single-turn
  rollouts: never named, the trainer scores the engine's ids).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from rlkit.algos.correction import engine_log_ratio, mismatch_summary
from rlkit.data.batch import Batch
from rlkit.diagnostics.rescore import Rescored

NOISE = 1e-3
"""Mean |delta| (nats per token) below which no cause is named: engine and trainer in fp32 agree to ~1e-6."""
EXPLAINED = 0.5
"""A hypothesis is named when it leaves at most this share of the gap."""
SUM_TOLERANCE = 1e-7
"""Relative difference of a tensor's sums beyond summation order (same values cast the same way agree to ~1e-15)."""


@dataclass
class MismatchReport:
    """``trainer.mismatch()``: the tokens, grouped four ways, the gap's statistics and the checks."""

    tokens: pd.DataFrame
    """One row per response token with an engine log-prob: sample, rank, group, turn (the model turn; 0: single-turn),
    position, token_id, token, engine_logprob, trainer_logprob, delta (trainer - engine), ratio (exp delta),
    abs_delta, repeated (the token occurred earlier in the prompt or response)."""
    by_position: pd.DataFrame
    by_token: pd.DataFrame
    """Sorted by the total |delta| the token carries (the tokens to look at first)."""
    by_rank: pd.DataFrame
    by_turn: pd.DataFrame
    summary: dict[str, float]
    """rlkit.algos.mismatch_summary of the tokens (k1, k3, chi2, |delta| mean and max, ratio stats, ESS)."""
    checks: pd.DataFrame
    """One row per check: check, named (bool), evidence, fix."""
    dtypes: dict[str, str]
    """The trainer's compute dtype and the engine's weight dtype."""
    sampling: dict[str, object]
    """The engine's sampling settings that transform the logits, as far as rlkit can read them."""

    @property
    def causes(self) -> list[str]:
        """The checks that named a cause."""
        return self.checks.loc[self.checks["named"], "check"].tolist()

    def __str__(self) -> str:
        s = self.summary
        head = (f"{int(s.get('tokens', 0))} tokens: mean |delta| {s.get('abs_delta_mean', math.nan):.3g}, "
                f"max {s.get('abs_delta_max', math.nan):.3g}, k3 {s.get('kl_k3', math.nan):.3g}")  # fmt: skip
        lines = [head, "causes: " + (", ".join(self.causes) or "none named")]
        for row in self.checks.itertuples():
            fix = f" -> {row.fix}" if row.named else ""
            lines.append(f"  [{'x' if row.named else ' '}] {row.check}: {row.evidence}{fix}")
        return "\n".join(lines)


def mismatch_report(
    batch: Batch,
    rescored: Sequence[Rescored],
    *,
    decode: Callable[[int], str] | None = None,
    gap_history: Sequence[float] = (),
) -> MismatchReport:
    """The report of ``batch`` (each rank's rows in order, as ``rescored`` holds them); ``gap_history``: the run's
    rollout/logprob_gap/mean per step (evidence of a jump)."""
    trainer = torch.cat([r.trainer for r in rescored])
    tokens = token_table(batch, trainer, decode or str)
    summary = mismatch_summary(trainer, batch.rollout_logprobs, batch.response_mask)
    checks = run_checks(batch, rescored, trainer, list(gap_history))
    return MismatchReport(
        tokens=tokens,
        by_position=grouped(tokens, "position"),
        by_token=grouped(tokens, ["token_id", "token"]).sort_values("total_abs_delta", ascending=False),
        by_rank=grouped(tokens, "rank"),
        by_turn=grouped(tokens, "turn"),
        summary=summary,
        checks=pd.DataFrame(checks, columns=["check", "named", "evidence", "fix"]),
        dtypes=rescored[0].dtypes,
        sampling=rescored[0].sampling,
    )


def token_table(batch: Batch, trainer: torch.Tensor, decode: Callable[[int], str]) -> pd.DataFrame:
    """One row per checked response token of ``batch`` with the trainer's log-probs ``trainer`` [B, T]."""
    delta, checked = engine_log_ratio(trainer, batch.rollout_logprobs, batch.response_mask)
    rows, positions = checked.nonzero(as_tuple=True)
    ids = batch.input_ids[:, batch.prompt_length :]
    token_ids = ids[rows, positions]
    rank = batch.rank[rows] if batch.rank is not None else torch.zeros_like(rows)
    turn = batch.turn_index[rows, positions] if batch.turn_index is not None else torch.zeros_like(rows)
    return pd.DataFrame({
        "sample": rows.tolist(),
        "rank": rank.tolist(),
        "group": batch.group[rows].tolist(),
        "turn": turn.tolist(),
        "position": positions.tolist(),
        "token_id": token_ids.tolist(),
        "token": [decode(int(i)) for i in token_ids],
        "engine_logprob": batch.rollout_logprobs[rows, positions].tolist(),
        "trainer_logprob": trainer[rows, positions].tolist(),
        "delta": delta[rows, positions].tolist(),
        "ratio": delta[rows, positions].clamp(-20, 20).exp().tolist(),
        "abs_delta": delta[rows, positions].abs().tolist(),
        "repeated": _repeated(batch)[rows, positions].tolist(),
    })  # fmt: skip


def grouped(tokens: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    """Per value of ``by``: tokens, mean delta, mean and max |delta|, their total, and k3 (mean ratio - 1 - delta)."""
    k3 = tokens["ratio"] - 1 - tokens["delta"]
    table = tokens.assign(k3=k3).groupby(by).agg(
        tokens=("delta", "size"),
        mean_delta=("delta", "mean"),
        mean_abs_delta=("abs_delta", "mean"),
        max_abs_delta=("abs_delta", "max"),
        total_abs_delta=("abs_delta", "sum"),
        k3=("k3", "mean"),
    )
    return table.reset_index()


def run_checks(
    batch: Batch, rescored: Sequence[Rescored], trainer: torch.Tensor, gap_history: list[float]
) -> list[tuple[str, bool, str, str]]:
    """(check, named, evidence, fix) for each check of the module doc."""
    gap = _gap(trainer, batch)
    sampling = rescored[0].sampling
    checks = [
        _hypothesis("sampling: temperature", gap, batch, _joined(rescored, "no_temperature"),
                    f"temperature={sampling.get('temperature')}: the trainer at temperature 1 leaves",
                    "the engine's log-probs are taken before the temperature: ask the engine for processed "
                    "log-probs (vLLM logprobs_mode='processed_logprobs', as rlkit's engine does)"),
        _truncation_check(gap, batch, rescored),
        _hypothesis("sampling: min_new_tokens", gap, batch, _joined(rescored, "no_early_eos"),
                    "the trainer with end-of-text suppressed before min_new_tokens leaves",
                    "the engine suppresses end-of-text before rollout.min_new_tokens and its log-probs are "
                    "renormalised without it, the trainer's are not: set min_new_tokens=0, or turn "
                    "rollout_correction on"),
        _penalty_check(gap, batch, rescored),
        _stale_check(rescored, gap_history),
        _dtype_check(gap, batch, rescored),
        _tokenisation_check(batch),
    ]  # fmt: skip
    return checks


def _tokenisation_check(batch: Batch) -> tuple[str, bool, str, str]:
    """Multi-turn rollouts: trajectories whose re-rendered conversation drifted from the ids the engine saw."""
    if batch.trajectories is None:
        return "tokenisation", False, "single-turn rollouts: engine and trainer score the same token ids", ""
    drifted = [t.drift for t in batch.trajectories if t.drift]
    evidence = (f"{len(drifted)} of {len(batch.trajectories)} trajectories' re-rendered conversations differ from "
                f"the engine's ids; first: {drifted[0]}" if drifted else
                "multi-turn rollouts: the trainer scores the engine's own ids (token in, token out), no drift")
    fix = ("the chat template renders earlier turns differently from how the model produced them: train on the "
           "engine's ids (rlkit does) and fix the template if the drift is in the prompt part")
    return "tokenisation", bool(drifted), evidence, fix if drifted else ""


def _hypothesis(
    name: str, gap: float, batch: Batch, scores: torch.Tensor | None, evidence: str, fix: str
) -> tuple[str, bool, str, str]:
    if scores is None:
        return name, False, "not applicable to these settings", ""
    if gap <= NOISE:
        return name, False, f"the gap ({gap:.2g} nats per token) is within the noise ({NOISE:g})", ""
    left = _gap(scores, batch)
    named = gap > NOISE and left <= EXPLAINED * gap
    return name, named, f"{evidence} {left:.3g} of a gap of {gap:.3g} nats per token", fix


NEUTRAL = {"top_k": (0, -1, None), "min_p": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
           "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "no_repeat_ngram_size": (0, None)}
"""Values of the engine's sampling settings that leave the distribution alone."""


def _static(rescored: Sequence[Rescored], names: tuple[str, ...]) -> dict[str, object]:
    """The engine's settings among ``names`` that change its distribution (the trainer applies none of them)."""
    return {k: v for k, v in rescored[0].sampling.items() if k in names and v not in NEUTRAL[k]}


def _truncation_check(gap: float, batch: Batch, rescored: Sequence[Rescored]) -> tuple[str, bool, str, str]:
    """top_p renormalises the engine's log-probs (a hypothesis); top_k and min_p truncate its sampling (settings)."""
    top_p = rescored[0].sampling.get("top_p")
    leaves = f"top_p={top_p}: the trainer renormalised over the nucleus leaves"
    nucleus = _joined(rescored, "nucleus")
    name, named, evidence, _ = _hypothesis("sampling: top_p/top_k", gap, batch, nucleus, leaves, "")
    static = _static(rescored, ("top_k", "min_p"))
    if static:
        evidence += f"; the engine also samples with {static}"
    fix = ("the engine samples from a truncated distribution (top-p nucleus, top-k, min-p) and the trainer scores "
           "the whole one: set rollout.top_p=1 and remove the others, or turn rollout_correction on")  # fmt: skip
    return name, named or bool(static), evidence, fix


def _penalty_check(gap: float, batch: Batch, rescored: Sequence[Rescored]) -> tuple[str, bool, str, str]:
    name = "sampling: repetition_penalty"
    penalties = sorted(rescored[0].penalised)
    if not penalties:
        return name, False, "not applicable", ""
    left = {p: _gap(torch.cat([r.penalised[p] for r in rescored]), batch) for p in penalties}
    best = min(left, key=left.__getitem__)
    static = _static(rescored, ("repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size"))
    named = bool(static) or gap > NOISE and left[best] <= EXPLAINED * gap
    evidence = (f"a penalty of {best:g} on repeated tokens leaves {left[best]:.3g} of a gap of {gap:.3g} nats per "
                f"token; the engine's settings show {static or 'none'}")  # fmt: skip
    fix = (f"the engine samples with a repetition penalty (about {best:g}) the trainer does not apply: remove it "
           "(vLLM generation_config='vllm'; a model's generation_config.json for Hugging Face generate)")  # fmt: skip
    return name, named, evidence, fix


def _stale_check(rescored: Sequence[Rescored], gap_history: list[float]) -> tuple[str, bool, str, str]:
    first = rescored[0]
    differ = [
        (tensor, abs(t_sq - e_sq) / max(t_sq, 1e-30))
        for tensor, t_sum, t_sq, e_sum, e_sq in first.checksums
        if abs(t_sq - e_sq) > SUM_TOLERANCE * max(t_sq, 1e-30) or abs(t_sum - e_sum) > SUM_TOLERANCE * math.sqrt(t_sq)
    ]
    behind = first.optimizer_steps - first.engine_synced_at
    readable = f"{len(first.checksums)} engine tensors compared" + (
        f" ({first.unreadable} unreadable)" if first.unreadable > 0 else ""
    )
    if first.unreadable < 0:
        readable = "engine tensors unreadable (tensor-parallel engine)"
    evidence = f"{readable}, {len(differ)} differ"
    if differ:
        tensor, rel = differ[0]
        evidence += f" (e.g. {tensor}: relative {rel:.2g})"
    evidence += f"; the engine holds optimizer step {first.engine_synced_at}, the actor {first.optimizer_steps}"
    if len(gap_history) >= 2 and gap_history[-1] > 10 * max(float(pd.Series(gap_history[:-1]).median()), NOISE / 10):
        evidence += f"; the gap jumped to {gap_history[-1]:.3g} at the last step"
    fix = "the engine does not hold the actor's weights: check the weight sync (time/worker/sync, the engine's logs)"
    return "stale weights", bool(differ) or behind > 0, evidence, fix


def _dtype_check(gap: float, batch: Batch, rescored: Sequence[Rescored]) -> tuple[str, bool, str, str]:
    dtypes = rescored[0].dtypes
    name = "dtype floor"
    lower = _joined(rescored, "engine_dtype")
    fp32 = _joined(rescored, "engine_fp32")
    if lower is None:
        same = f"engine ({dtypes.get('engine')}) and trainer ({dtypes.get('trainer')}) share a precision"
        return name, False, same, ""
    trainer = torch.cat([r.trainer for r in rescored])
    floor = float(_abs_mean(trainer, lower, batch))
    evidence = f"engine {dtypes.get('engine')} vs trainer {dtypes.get('trainer')}: the trainer's own floor {floor:.3g}"
    if fp32 is not None:
        evidence += f"; the engine's own weights computed in fp32 leave {_abs_mean(trainer, fp32, batch):.3g}"
    evidence += f" of a gap of {gap:.3g} nats per token"
    named = NOISE < gap <= 3 * max(floor, NOISE)
    fix = ("numerical noise of the engine's lower precision, not a bug: rollout_correction absorbs it, or run "
           "the engine in the trainer's dtype (fsdp.param_dtype)")  # fmt: skip
    return name, named, evidence, fix


def _joined(rescored: Sequence[Rescored], field: str) -> torch.Tensor | None:
    parts = [getattr(r, field) for r in rescored]
    return None if any(p is None for p in parts) else torch.cat(parts)


def _gap(scores: torch.Tensor, batch: Batch) -> float:
    """Mean |scores - engine| over the tokens with an engine log-prob."""
    return float(_abs_mean(scores, batch.rollout_logprobs, batch))


def _abs_mean(a: torch.Tensor, b: torch.Tensor, batch: Batch) -> torch.Tensor:
    delta, checked = engine_log_ratio(a, b, batch.response_mask)
    return delta.abs()[checked].mean() if checked.any() else torch.tensor(math.nan)


def _repeated(batch: Batch) -> torch.Tensor:
    """[B, T] bool: the response token occurred earlier in its prompt or response."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    width = batch.response_mask.shape[1]
    for i in range(len(batch)):
        seen = set(batch.input_ids[i, :-width][batch.attention_mask[i, :-width].bool()].tolist())
        for t, token in enumerate(batch.input_ids[i, -width:].tolist()):
            out[i, t] = token in seen
            seen.add(token)
    return out
