"""The controller's side of ``trainer.mismatch()`` and ``trainer.certify()``: each rank's re-scoring of a rollout
nothing trains on (:meth:`PolicyWorker.mismatch_probe`), the report (:mod:`rlkit.diagnostics.mismatch`) and the
gap against its floor."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from rlkit.config import RolloutConfig
from rlkit.data.batch import Batch
from rlkit.diagnostics.mismatch import MismatchReport, mismatch_report
from rlkit.runtime import PerRank, RoleGroup
from rlkit.workers import PolicyWorker
from rlkit.workers.batches import Rows

CERTIFY_SEED = 424_242
"""The sampling seed of :func:`certify`'s rollout (offset by the config's seed and the rank)."""


@dataclass
class GapFloor:
    """``trainer.certify()``: the engine-vs-trainer gap of a fixed-seed rollout for this model, engine and settings,
    against the floor measured on the same rows."""

    engine: str
    dtypes: dict[str, str]
    """The trainer's compute dtype and the engine's weight dtype."""
    temperature: float
    top_p: float
    tokens: int
    abs_delta_mean: float
    """Mean ``|trainer - engine|`` log-prob per token (nats): the floor every step's mismatch metrics sit on."""
    abs_delta_p99: float
    abs_delta_max: float
    kl_k3: float
    floor: float
    """Mean ``|trainer - reference|`` over the same tokens (rlkit.diagnostics.floor): what an honest engine leaves; at
    least the dtype's least floor where the reference repeats the trainer's own arithmetic (vLLM in bf16)."""
    tolerance: float
    """The excess over the floor still called the floor (3 standard errors over the rows + FLOAT_NOISE, 1e-4)."""
    causes: list[str]
    """The checks of :class:`~rlkit.diagnostics.mismatch.MismatchReport` that named a cause."""
    verdict: str
    """"clean: ..." only when no cause is named and the gap is within the tolerance of the floor on every rank;
    otherwise the causes named, or "unexplained: N x the floor" with what was ruled out."""
    report: MismatchReport

    @property
    def clean(self) -> bool:
        return self.report.clean

    def to_pandas(self) -> pd.DataFrame:
        """One row: the settings, the gap and the floor, the verdict."""
        row = {k: v for k, v in vars(self).items() if k not in ("report", "dtypes", "causes")}
        return pd.DataFrame([{**row, **{f"{k}_dtype": v for k, v in self.dtypes.items()}, "causes": self.causes}])

    def __str__(self) -> str:
        return (f"gap ({self.engine} engine {self.dtypes.get('engine')}, trainer {self.dtypes.get('trainer')}, "
                f"temperature {self.temperature:g}, top_p {self.top_p:g}): mean |delta| {self.abs_delta_mean:.3g}, "
                f"p99 {self.abs_delta_p99:.3g}, max {self.abs_delta_max:.3g}, k3 {self.kl_k3:.3g} over "
                f"{self.tokens} tokens; {self.verdict}")  # fmt: skip


def probe(
    policy: RoleGroup,
    batch: Batch,
    max_rows: int,
    decode: Callable[[int], str],
    gap_history: list[float],
    correction_on: bool = False,
) -> MismatchReport:
    """Each rank re-scores the first ``max_rows / world size`` of its rows of ``batch`` that carry engine log-probs
    (as many on every rank); the report of those rows. ``gap_history``: the run's rollout/logprob_gap/mean;
    ``correction_on``: the run's rollout_correction is on."""
    ranks = policy.cluster.world_size
    shards = batch.split(ranks)
    with_engine = [torch.ones(len(s), dtype=torch.bool) if s.rollout_logprob_rows is None else s.rollout_logprob_rows
                   for s in shards]  # fmt: skip
    per_rank = min([max(1, max_rows // ranks)] + [int(rows.sum()) for rows in with_engine])
    if per_rank == 0:
        raise ValueError("a rank's rollout has no engine log-probs to compare: set rollout.engine_logprobs > 0")
    picked = [s.select(rows.nonzero().squeeze(1)[:per_rank]) for s, rows in zip(shards, with_engine, strict=True)]
    rows = [Rows(input_ids=s.input_ids, attention_mask=s.attention_mask, response_mask=s.response_mask) for s in picked]
    rescored = policy.call(PolicyWorker.mismatch_probe, PerRank(rows))
    return mismatch_report(Batch.concat(picked), rescored, decode=decode, gap_history=gap_history,
                           correction_on=correction_on)  # fmt: skip


def certify_rows(side_rollout: Callable[[list[int]], Batch], seed: int, ranks: int, max_rows: int) -> Batch:
    """Fixed-seed rollouts (``side_rollout(seeds)``, one seed per rank) until there are ``max_rows`` rows, joined so
    that each rank's share still holds the rows its own engine generated (the floor is judged per rank)."""
    batches: list[Batch] = []
    while not batches or sum(len(b) for b in batches) < max_rows:
        first = seed * 1_000_003 + CERTIFY_SEED + len(batches) * ranks
        batches.append(side_rollout([first + r for r in range(ranks)]))
    return Batch.concat([part for r in range(ranks) for part in (b.split(ranks)[r] for b in batches)])


def gap_floor(report: MismatchReport, rollout: RolloutConfig) -> GapFloor:
    """``trainer.certify()``'s summary of the report of a fixed-seed rollout."""
    gaps, s = report.tokens["abs_delta"], report.summary
    return GapFloor(
        engine=rollout.engine,
        dtypes=report.dtypes,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        tokens=int(s.get("tokens", 0)),
        abs_delta_mean=s.get("abs_delta_mean", math.nan),
        abs_delta_p99=float(gaps.quantile(0.99)) if len(gaps) else math.nan,
        abs_delta_max=s.get("abs_delta_max", math.nan),
        kl_k3=s.get("kl_k3", math.nan),
        floor=report.floor.floor,
        tolerance=report.floor.tolerance,
        causes=report.causes,
        verdict=report.verdict,
        report=report,
    )
