"""The floor a mismatch is held against, per rank and over all of them (plain data; pure functions).

The gap is mean ``|trainer - engine|`` per token; the floor is mean ``|trainer - reference|`` over the same
tokens, where the reference is the trainer's own weights in the engine's arithmetic (the hf engine: a copy of its
model holding the trainer's weights, so an honest engine sits at the floor to ~1e-7; vLLM: the trainer's forward
in the other layout, under autocast to the engine's dtype where that is lower).

Where engine and trainer compute in the same dtype below fp32 and rlkit does not hold the engine's model (vLLM in
bf16 on a GPU), no reference is a second implementation: the trainer's other layout repeats its own arithmetic
(bit for bit with rows of one length), so the measured floor says 0 while two correct bf16 implementations
(different kernels, fused ops, batch shapes) differ by their rounding. There the floor is at least the dtype's
minimum, :data:`DTYPE_FLOORS`, measured between vLLM and the trainer on a GPU, and its tolerance comes from the
spread of the gap itself over the rows (an honest engine's gap is a sample of the floor).

A gap is within the floor when two figures are each within their tolerance, :data:`Z` standard errors measured over
the rows (the rows are the independent draws; their tokens are not) plus :data:`FLOAT_NOISE`:

- the excess of the gap over the floor, mean ``|trainer - engine|`` - mean ``|trainer - reference|``, against the
  spread of the floor itself (an honest engine's gap varies as the floor does: the standard error of a difference of
  two such means, sqrt(2) x the floor's). Not the excess's own spread: a far-off engine's gaps vary so much that
  a test against their own spread can call 1e5 x the floor noise;
- the bias, mean (reference - engine), against its own spread: the engine's log-probs shifted one way from the
  reference's. Rounding moves log-probs both ways; a truncated or re-weighted sampler (a top-k, a penalty) moves
  them one way, which shows here long before it shows in the absolute gap when the floor is large (bf16).

Measured on the tiny model (2 CPU ranks, 16 rows of 8 tokens each, seeds 1 and 2): fp32 engine gap 3.7e-7 and
4.0e-7 against floors 3.3e-7 and 3.4e-7; bf16 engine gap 4.34e-3 against a floor of 4.34e-3 (engine against the
reference: 2e-7); a top-k of 8 in the sampler: fp32 gap 7.1e-3 and 8.2e-3, bf16 9.1e-3 and 1.0e-2 (2.1x and 2.3x
the floor); a top-k of 4: 3.5e-2 to 4.0e-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

DTYPE_FLOORS = {"bfloat16": 8e-3, "float16": 1e-3}
"""The least floor (nats per token) between two correct implementations in a dtype, for a reference that cannot
be a second one. bf16: the healthy 0.5B run of issue 43's second H100 lease (vLLM 0.24 against the trainer, 16
prompts x 8, fixed lengths, one rank) read a gap of 0.0078. fp16 carries 3 more mantissa bits: bf16's / 8."""
Z = 3.0
"""Standard errors of the excess over the floor that a gap may carry and still be the floor."""
FLOAT_NOISE = 1e-4
"""Nats per token below which an excess is rounding between two implementations in any dtype. vLLM's CPU kernels
against the trainer's padded forward, both fp32, measured: excess up to 4.8e-6 on one rank (CI, 2026-12-03), where
1e-6 failed a clean run. The smallest planted cause measured is 50x this (a top-k of 8, fp32: 5.7e-3), and an
importance ratio off by 1e-4 is far below any clip."""


@dataclass
class Floor:
    """The gap against the floor, over all ranks and per rank."""

    tokens: int
    gap: float
    """Mean ``|trainer - engine|`` log-prob per checked token (nats)."""
    floor: float
    """Mean ``|trainer - reference|`` over the same tokens."""
    tolerance: float
    """The excess gap - floor allowed: Z x sqrt(2) x the floor's standard error over the rows + FLOAT_NOISE."""
    factor: float
    """gap / floor (inf for a floor of 0)."""
    bias: float
    """Mean (reference - engine) log-prob per checked token."""
    bias_tolerance: float
    """The ``|bias|`` allowed: Z x its standard error over the rows + FLOAT_NOISE."""
    reference: str
    """How the reference was computed."""
    minimum: float
    """The least floor the dtype allows (:data:`DTYPE_FLOORS`; 0 where the reference is a second implementation)."""
    by_rank: pd.DataFrame
    """One row per rank: rank, rows, tokens, gap, floor, tolerance, factor (gap / floor), bias, bias_tolerance,
    within (bool)."""

    @property
    def within(self) -> bool:
        """The gap is within the tolerance of the floor and unbiased, on every rank and over all of them (no checked
        token at all: not within, nothing was measured)."""
        names = ("tokens", "gap", "floor", "tolerance", "bias", "bias_tolerance")
        overall = self.tokens > 0 and _within({name: getattr(self, name) for name in names})
        return overall and bool(self.by_rank["within"].all())

    @property
    def outliers(self) -> list[str]:
        """Each rank beyond its tolerance, with its figures."""
        return [f"rank {r.rank}: gap {r.gap:.3g} = {_times(r.factor)} its floor {r.floor:.3g} (tolerance "
                f"+{r.tolerance:.2g}), bias {r.bias:+.2g} (tolerance {r.bias_tolerance:.2g})"
                for r in self.by_rank.itertuples() if not r.within]  # fmt: skip

    def __str__(self) -> str:
        least = f", at least the dtype's {self.minimum:g}" if self.minimum else ""
        return (f"gap {self.gap:.3g} against a floor of {self.floor:.3g}{least} ({_times(self.factor)}; tolerance "
                f"+{self.tolerance:.2g}), bias {self.bias:+.2g} (tolerance {self.bias_tolerance:.2g}); tolerances: "
                f"{Z:g} standard errors over the rows + {FLOAT_NOISE:g}; reference: {self.reference}")  # fmt: skip


def measure_floor(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    reference: torch.Tensor,
    checked: torch.Tensor,
    rank: torch.Tensor,
    kind: str,
    minimum: float = 0.0,
) -> Floor:
    """The floor of [B, T] ``trainer`` log-probs against ``engine`` and ``reference`` on the ``checked`` tokens
    ([B, T] bool), over all rows and per ``rank`` ([B] the rank that scored each row), held at ``minimum`` at least
    (the gap's own spread then gives its tolerance)."""
    sums = {
        "gap": _row_sums((trainer.double() - engine.double()).abs(), checked),
        "floor": _row_sums((trainer.double() - reference.double()).abs(), checked),
        "bias": _row_sums(reference.double() - engine.double(), checked),
        "tokens": checked.sum(dim=1).double(),
    }
    overall = _compare(sums, minimum)
    per_rank = []
    for r in sorted(set(rank.tolist())):
        figures = _compare({name: values[rank == r] for name, values in sums.items()}, minimum)
        per_rank.append({"rank": r, "rows": int((rank == r).sum()), **figures, "within": _within(figures)})
    return Floor(**overall, reference=kind, minimum=minimum, by_rank=pd.DataFrame(per_rank))


def _within(figures: dict) -> bool:
    """Both excesses within their tolerances (a rank without checked tokens: nothing to hold against the floor)."""
    if figures["tokens"] == 0:
        return True
    excess_within = figures["gap"] - figures["floor"] <= figures["tolerance"]
    return excess_within and abs(figures["bias"]) <= figures["bias_tolerance"]


def _row_sums(values: torch.Tensor, checked: torch.Tensor) -> torch.Tensor:
    """[B] float64 sums of [B, T] ``values`` over each row's checked tokens."""
    return torch.where(checked, values, 0.0).sum(dim=1)


def _compare(sums: dict[str, torch.Tensor], minimum: float) -> dict:
    """gap, floor, tolerance, bias, bias_tolerance (and tokens, factor) from per-row sums and token counts ([B]
    each); the standard errors are the ratio estimator's over the rows (tokens weigh as they do in the means). A
    floor below ``minimum`` is raised to it, with the spread of the gap for the floor's."""
    tokens = sums["tokens"]
    total = float(tokens.sum())
    if total == 0:
        return {"tokens": 0, "gap": math.nan, "floor": math.nan, "tolerance": math.nan, "factor": math.nan,
                "bias": math.nan, "bias_tolerance": math.nan}  # fmt: skip
    gap, floor, bias = (float(sums[name].sum()) / total for name in ("gap", "floor", "bias"))
    spread = _standard_error(sums["floor"], tokens, floor)
    if floor < minimum:
        floor, spread = minimum, _standard_error(sums["gap"], tokens, gap)
    return {"tokens": int(total), "gap": gap, "floor": floor, "factor": _factor(gap, floor),
            "tolerance": Z * math.sqrt(2) * spread + FLOAT_NOISE,
            "bias": bias, "bias_tolerance": Z * _standard_error(sums["bias"], tokens, bias) + FLOAT_NOISE}  # fmt: skip


def _standard_error(row_sums: torch.Tensor, tokens: torch.Tensor, mean: float) -> float:
    """The standard error of the token-weighted mean ``mean`` of per-row sums over the rows with tokens."""
    rows = int((tokens > 0).sum())
    residual = row_sums - mean * tokens
    return math.sqrt(float(residual.square().sum()) * rows / max(rows - 1, 1)) / float(tokens.sum())


def _factor(gap: float, floor: float) -> float:
    return gap / floor if floor > 0 else math.inf


def _times(factor: float) -> str:
    return "inf x" if math.isinf(factor) else f"{factor:.3g}x"
