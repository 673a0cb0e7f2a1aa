"""Why the rollout engine and the trainer disagree: per-token gaps, grouped, a floor, and checks that name causes.

:func:`mismatch_report` joins a rollout (a :class:`~rlkit.data.batch.Batch` nothing has trained on yet) with each
rank's :class:`~rlkit.diagnostics.rescore.Rescored` and returns a :class:`MismatchReport`. The gap, mean ``|delta|``
over the tokens with an engine log-prob (delta = trainer - engine, the trainer scoring through the update's forward), is
held against a floor measured on the same rows (:mod:`rlkit.diagnostics.floor`), per rank and over all of them. The
checks:

- "sampling: temperature", "sampling: top_p/top_k", "sampling: min_new_tokens", "sampling: repetition_penalty":
  the trainer's logits transformed as the engine would (see rlkit.diagnostics.rescore) reproduce the engine's
  log-probs: named when the gap is beyond the floor's tolerance and the hypothesis removes at least 90% of its
  excess over the floor, or when the engine's own settings show a top-k, min-p or penalty (which can change the
  samples without showing in its log-probs) or a temperature other than the config's (checked at every configured
  temperature, 1 included: the engine at 0.8 against a config of 1, or the temperature applied twice);
- "stale weights": on any rank, an engine tensor's fingerprint (rlkit.models.fingerprint: random projections that
  see order) differs from the trainer's (cast to the engine's dtype), or the engine last confirmed an older
  optimizer step's weights than the actor holds;
- "tokenisation": multi-turn rollouts whose re-rendered conversation drifted from the engine's ids (single-turn
  rollouts: never named, the trainer scores the engine's ids).

The verdict: "clean" only when no check names a cause and the gap is within the floor's tolerance on every rank;
"unexplained: N x the floor" when it is not and no check names a cause (with what was ruled out: the checks that
ran, not those the settings made inapplicable, and the ranks beyond their floors); otherwise the causes named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from rlkit.algos.correction import engine_log_ratio, mismatch_summary
from rlkit.data.batch import Batch
from rlkit.diagnostics.floor import Floor, measure_floor
from rlkit.diagnostics.rescore import Rescored
from rlkit.models.fingerprint import TOLERANCE as FINGERPRINT_TOLERANCE

Check = tuple[str, bool, bool, str, str]
"""(check, named, ran, evidence, fix)."""

EXPLAINED = 0.1
"""A hypothesis is named when it leaves at most this share of the gap's excess over the floor (or none beyond the
floor's tolerance): a grid of top-k values or penalties removes part of any gap (stale weights too), so only a
hypothesis that removes nearly all of it is a cause."""


@dataclass
class MismatchReport:
    """``trainer.mismatch()``: the tokens, grouped four ways, the gap's statistics and the checks."""

    tokens: pd.DataFrame
    """One row per response token with an engine log-prob: sample, rank, group, turn (the model turn; 0: single-turn),
    position, token_id, token, engine_logprob, trainer_logprob, delta (trainer - engine), ratio (exp delta),
    abs_delta, repeated (the token occurred earlier in the prompt or response)."""
    by_position: pd.DataFrame
    by_token: pd.DataFrame
    """Sorted by the total ``|delta|`` the token carries (the tokens to look at first)."""
    by_rank: pd.DataFrame
    by_turn: pd.DataFrame
    summary: dict[str, float]
    """rlkit.algos.mismatch_summary of the tokens (k1, k3, chi2, ``|delta|`` mean and max, ratio stats, ESS)."""
    checks: pd.DataFrame
    """One row per check: check, named (bool), ran (bool: False where the settings or the rollout left nothing to
    test), evidence, fix."""
    floor: Floor
    """The gap against the floor measured on the same rows, over all ranks and per rank."""
    dtypes: dict[str, str]
    """The trainer's compute dtype and the engine's weight dtype."""
    sampling: dict[str, object]
    """The engine's sampling settings that transform the logits, as far as rlkit can read them."""

    @property
    def causes(self) -> list[str]:
        """The checks that named a cause."""
        return self.checks.loc[self.checks["named"], "check"].tolist()

    @property
    def clean(self) -> bool:
        """No cause named and the gap within the floor's tolerance on every rank."""
        return not self.causes and self.floor.within

    @property
    def verdict(self) -> str:
        """"clean: ...", "causes named: ..." or "unexplained: N x the floor; ruled out: ..."."""
        ranks = "; ".join(self.floor.outliers)
        if self.causes:
            return "causes named: " + ", ".join(self.causes) + (f" ({ranks})" if ranks else "")
        if self.floor.within:
            return f"clean: the gap is within the tolerance of the floor ({self.floor})"
        ruled_out = ", ".join(self.checks.loc[self.checks["ran"] & ~self.checks["named"], "check"]) or "nothing"
        return (f"unexplained: {self.floor.factor:.3g} x the floor ({self.floor}); ruled out: {ruled_out}"
                + (f"; beyond their floors: {ranks}" if ranks else ""))  # fmt: skip

    def __str__(self) -> str:
        s = self.summary
        head = (f"{int(s.get('tokens', 0))} tokens: mean |delta| {s.get('abs_delta_mean', math.nan):.3g}, "
                f"max {s.get('abs_delta_max', math.nan):.3g}, k3 {s.get('kl_k3', math.nan):.3g}")  # fmt: skip
        lines = [head, self.verdict]
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
    correction_on: bool = False,
) -> MismatchReport:
    """The report of ``batch`` (each rank's rows in order, as ``rescored`` holds them); ``correction_on``: the run's
    rollout_correction is on (the fixes then do not offer it); ``gap_history``: the run's
    rollout/logprob_gap/mean per step (evidence of a jump)."""
    trainer = torch.cat([r.trainer for r in rescored])
    tokens = token_table(batch, trainer, decode or str)
    summary = mismatch_summary(trainer, batch.rollout_logprobs, batch.response_mask)
    floor = _floor(batch, rescored, trainer)
    checks = run_checks(batch, rescored, floor, list(gap_history), correction_on)
    return MismatchReport(
        tokens=tokens,
        by_position=grouped(tokens, "position"),
        by_token=grouped(tokens, ["token_id", "token"]).sort_values("total_abs_delta", ascending=False),
        by_rank=grouped(tokens, "rank"),
        by_turn=grouped(tokens, "turn"),
        summary=summary,
        checks=pd.DataFrame(checks, columns=["check", "named", "ran", "evidence", "fix"]),
        floor=floor,
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
    """Per value of ``by``: tokens, mean delta, mean and max ``|delta|``, their total, and k3 (mean ratio - 1 -
    delta)."""
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
    batch: Batch, rescored: Sequence[Rescored], floor: Floor, gap_history: list[float], correction_on: bool = False
) -> list[Check]:
    """(check, named, ran, evidence, fix) for each check of the module doc."""
    correct = _correction_hint(correction_on)
    checks = [
        _temperature_check(floor, batch, rescored),
        _truncation_check(floor, batch, rescored, correct),
        _hypothesis("sampling: min_new_tokens", floor, batch, _joined(rescored, "no_early_eos"),
                    "the trainer with end-of-text suppressed before min_new_tokens leaves",
                    "the engine suppresses end-of-text before rollout.min_new_tokens and its log-probs are "
                    f"renormalised without it, the trainer's are not: set min_new_tokens=0{correct}"),
        _penalty_check(floor, batch, rescored),
        _stale_check(rescored, gap_history),
        _tokenisation_check(batch),
    ]  # fmt: skip
    return checks


def _floor(batch: Batch, rescored: Sequence[Rescored], trainer: torch.Tensor) -> Floor:
    """The gap against the floor (no reference: a floor of 0, as for hand-made re-scorings)."""
    reference = _joined(rescored, "reference")
    kind = rescored[0].reference_kind if reference is not None else "none (a floor of 0)"
    _, checked = engine_log_ratio(trainer, batch.rollout_logprobs, batch.response_mask)
    rank = torch.cat([torch.full((len(r.trainer),), r.rank) for r in rescored])
    minimum = max(r.floor_minimum for r in rescored)
    return measure_floor(trainer, batch.rollout_logprobs, trainer if reference is None else reference, checked,
                         rank, kind, minimum)  # fmt: skip


def _tokenisation_check(batch: Batch) -> Check:
    """Multi-turn rollouts: trajectories whose re-rendered conversation drifted from the ids the engine saw."""
    if batch.trajectories is None:
        return "tokenisation", False, False, "single-turn rollouts: engine and trainer score the same token ids", ""
    drifted = [t.drift for t in batch.trajectories if t.drift]
    evidence = (f"{len(drifted)} of {len(batch.trajectories)} trajectories' re-rendered conversations differ from "
                f"the engine's ids; first: {drifted[0]}" if drifted else
                "multi-turn rollouts: the trainer scores the engine's own ids (token in, token out), no drift")
    fix = ("the chat template renders earlier turns differently from how the model produced them: train on the "
           "engine's ids (rlkit does) and fix the template if the drift is in the prompt part")
    return "tokenisation", bool(drifted), True, evidence, fix if drifted else ""


def _hypothesis(
    name: str, floor: Floor, batch: Batch, scores: torch.Tensor | None, evidence: str, fix: str
) -> Check:
    if scores is None:
        return name, False, False, "not applicable to these settings", ""
    if floor.within:
        return name, False, True, f"the gap ({floor.gap:.2g} nats per token) is within the floor's tolerance", ""
    left = _gap(scores, batch)
    return name, _explains(left, floor), True, f"{evidence} {left:.3g} of a gap of {floor.gap:.3g} nats per token", fix


def _explains(left: float, floor: Floor) -> bool:
    """A hypothesis that leaves ``left`` brings a gap beyond the floor back within its tolerance, or removes at least
    EXPLAINED of its excess over the floor."""
    excess = left - floor.floor
    return not floor.within and (excess <= floor.tolerance or excess <= EXPLAINED * (floor.gap - floor.floor))


NEUTRAL = {"top_k": (0, -1, None), "min_p": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
           "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "no_repeat_ngram_size": (0, None)}
"""Values of the engine's sampling settings that leave the distribution alone."""


def _static(rescored: Sequence[Rescored], names: tuple[str, ...]) -> dict[str, object]:
    """The engine's settings among ``names`` that change its distribution (the trainer applies none of them)."""
    return {k: v for k, v in rescored[0].sampling.items() if k in names and v not in NEUTRAL[k]}


def _correction_hint(on: bool) -> str:
    """How a fix ends: offering rollout_correction, or saying what it does not do when it is already on."""
    if on:
        return (" (rollout_correction is already on: it reweights these tokens, but a weight cannot bring back what "
                "the engine never samples)")  # fmt: skip
    return ", or turn rollout_correction on"


def _temperature_check(floor: Floor, batch: Batch, rescored: Sequence[Rescored]) -> Check:
    """The engine's effective temperature against the config's, whatever its value: the temperature the engine
    reports, and the trainer re-scored at each other temperature (rlkit.diagnostics.rescore.effective_temperatures)."""
    name = "sampling: temperature"
    configured, reported = rescored[0].temperature, rescored[0].sampling.get("temperature")
    reported_differs = isinstance(reported, int | float) and not math.isclose(reported or 1.0, configured)
    left = {t: _gap(torch.cat([r.temperatures[t] for r in rescored]), batch) for t in sorted(rescored[0].temperatures)}
    best = min(left, key=left.__getitem__) if left else None
    scored_differs = best is not None and _explains(left[best], floor)
    evidence = f"the engine reports temperature {reported}, the config {configured:g}"
    if best is not None:
        evidence = (f"the trainer at temperature {best:g} leaves {left[best]:.3g} of a gap of {floor.gap:.3g} nats per "
                    f"token; {evidence}")  # fmt: skip
    if not (reported_differs or scored_differs):
        return name, False, True, evidence, ""
    fix = (f"the engine samples at temperature {best if scored_differs else reported:g} and the trainer scores at "
           f"rollout.temperature={configured:g}: give both the same one (remove a temperature the engine applies "
           "itself: a model's generation_config, a logits processor, a sampler default), with the engine's log-probs "
           "taken after it (vLLM logprobs_mode='processed_logprobs', as rlkit's engine does)")  # fmt: skip
    return name, True, True, evidence, fix


def _truncation_check(
    floor: Floor, batch: Batch, rescored: Sequence[Rescored], correct: str
) -> Check:
    """top_p and top_k renormalise the engine's log-probs (hypotheses: the nucleus, each k of the grid); top_k and
    min_p among the engine's settings truncate its sampling."""
    name = "sampling: top_p/top_k"
    candidates = {f"top_p={rescored[0].sampling.get('top_p')}": _joined(rescored, "nucleus")}
    candidates.update({f"top_k={k}": torch.cat([r.top_k[k] for r in rescored]) for k in sorted(rescored[0].top_k)})
    left = {label: _gap(scores, batch) for label, scores in candidates.items() if scores is not None}
    static = _static(rescored, ("top_k", "min_p"))
    evidence = f"the engine's settings show {static or 'no top-k or min-p'}"
    best = min(left, key=left.__getitem__) if left else None
    named = best is not None and _explains(left[best], floor)
    if best is not None:
        evidence = (f"the trainer renormalised as {best} leaves {left[best]:.3g} of a gap of {floor.gap:.3g} nats "
                    f"per token; {evidence}")  # fmt: skip
    fix = (f"the engine samples from a truncated distribution ({best if named else 'top-p, top-k, min-p'}) and the "
           "trainer scores the whole one: set rollout.top_p=1 and remove the others (a model's generation_config, "
           f"a sampler default, a logits processor){correct}")  # fmt: skip
    return name, named or bool(static), True, evidence, fix


def _penalty_check(floor: Floor, batch: Batch, rescored: Sequence[Rescored]) -> Check:
    name = "sampling: repetition_penalty"
    penalties = sorted(rescored[0].penalised)
    if not penalties:
        return name, False, False, "not applicable", ""
    left = {p: _gap(torch.cat([r.penalised[p] for r in rescored]), batch) for p in penalties}
    best = min(left, key=left.__getitem__)
    static = _static(rescored, ("repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size"))
    named = bool(static) or _explains(left[best], floor)
    evidence = (f"a penalty of {best:g} on repeated tokens leaves {left[best]:.3g} of a gap of {floor.gap:.3g} nats "
                f"per token; the engine's settings show {static or 'none'}")  # fmt: skip
    fix = (f"the engine samples with a repetition penalty (about {best:g}) the trainer does not apply: remove it "
           "(vLLM generation_config='vllm'; a model's generation_config.json for Hugging Face generate)")  # fmt: skip
    return name, named, True, evidence, fix


def _stale_check(rescored: Sequence[Rescored], gap_history: list[float]) -> Check:
    """Every rank's engine: fingerprints against its trainer's gathered weights, and the confirmed sync step."""
    findings, compared = [], []
    for r in rescored:
        differ = [(tensor, rel) for tensor, rel in r.fingerprints if rel > FINGERPRINT_TOLERANCE]
        compared.append(len(r.fingerprints))
        if differ:
            tensor, rel = max(differ, key=lambda item: item[1])
            findings.append(f"rank {r.rank}: {len(differ)} of {len(r.fingerprints)} engine tensors' fingerprints "
                            f"differ from the trainer's (most: {tensor}, by {rel:.2g} of its scale)")  # fmt: skip
        if r.optimizer_steps != r.engine_synced_at:
            findings.append(f"rank {r.rank}: the engine last confirmed the weights of optimizer step "
                            f"{r.engine_synced_at}, the actor holds step {r.optimizer_steps}")  # fmt: skip
    unreadable = [r.rank for r in rescored if r.unreadable < 0]
    evidence = "; ".join(findings) or (f"fingerprints of {min(compared)}-{max(compared)} engine tensors per rank "
                                       f"on {len(rescored)} ranks, none differ; each engine holds its actor's "
                                       f"optimizer step {rescored[0].optimizer_steps}")  # fmt: skip
    if unreadable:
        evidence += f"; ranks {unreadable}: engine tensors unreadable (tensor-parallel engine)"
    elif any(r.unreadable > 0 for r in rescored):
        evidence += f" ({max(r.unreadable for r in rescored)} engine tensors unreadable)"
    if len(gap_history) >= 2 and gap_history[-1] > 10 * max(float(pd.Series(gap_history[:-1]).median()), 1e-6):
        evidence += f"; the gap jumped to {gap_history[-1]:.3g} at the last step"
    fix = "the engine does not hold the actor's weights: check the weight sync (time/worker/sync, the engine's logs)"
    return "stale weights", bool(findings), True, evidence, fix


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
