"""Gradient-norm consistency: per-rank local norms per unit, the true global norm, and cross-rank agreement.

On every rank after backward (before the optimizer step and before clipping
changes the gradients) call :func:`grad_report`; combine the reports with
:func:`grad_norms`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from rlkit.diagnostics.agreement import checksum, outliers
from rlkit.diagnostics.inspection import replica_key
from rlkit.diagnostics.layout import discover, unit_label


@dataclass(kw_only=True)
class GradEntry:
    """One parameter's gradient on one rank."""

    name: str
    unit: str | None
    shards: int
    shard_index: int
    sumsq: float
    """Sum of squares of this rank's gradient elements (float64)."""


@dataclass(kw_only=True)
class GradReport:
    """One rank's gradients: plain data."""

    rank: int
    world_size: int
    loss: float | None
    """The loss this rank reports; pass one all ranks must agree on (e.g. all-reduced)."""
    global_norm: float | None
    """The global gradient norm this rank computed (e.g. what ``clip_grad_norm_`` returned)."""
    entries: list[GradEntry]
    checksums: dict[str, int] = field(default_factory=dict)
    """Fingerprints of replicated gradients and parameters ("grad:name", "param:name", see ``replica_key``)."""


def grad_report(model: nn.Module, *, loss: float | torch.Tensor | None = None,
                global_norm: float | torch.Tensor | None = None) -> GradReport:
    """This rank's local gradient norms and replica fingerprints of ``model`` (FSDP1, FSDP2 or plain)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = [p for p in discover(model).params if p.requires_grad]  # LoRA: the adapters, not the frozen base
    grads = [p.grad() for p in params]
    sums = _sumsq([g for g in grads if g is not None])
    entries, checksums = [], {}
    for p, g in zip(params, grads, strict=True):
        sumsq = 0.0 if g is None else sums.pop(0)
        entries.append(GradEntry(name=p.name, unit=p.unit, shards=p.shards, shard_index=p.shard_index, sumsq=sumsq))
        if p.shards < world:
            checksums[replica_key("param", p.name, p.shards, p.shard_index)] = checksum(p.local())
            if g is not None:
                checksums[replica_key("grad", p.name, p.shards, p.shard_index)] = checksum(g)
    return GradReport(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        world_size=world,
        loss=None if loss is None else float(loss),
        global_norm=None if global_norm is None else float(global_norm),
        entries=entries,
        checksums=checksums,
    )


def _sumsq(grads: list[torch.Tensor]) -> list[float]:
    """Float64 sums of squares, one device sync per device."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        by_device[g.device].append(i)
    out = [0.0] * len(grads)
    for indices in by_device.values():
        values = torch.stack([grads[i].detach().double().pow(2).sum() for i in indices]).tolist()
        for i, v in zip(indices, values, strict=True):
            out[i] = v
    return out


@dataclass
class GradNorms:
    """Combined gradient report of all ranks. ``to_pandas()`` is :attr:`units`."""

    global_norm: float
    """The true global norm, from every rank's local pieces (replicated pieces counted once)."""
    units: pd.DataFrame
    """One row per unit (see :func:`unit_label`): ``rank{r}`` local norms, then ``global``, its norm over all ranks."""
    ranks: pd.DataFrame
    """One row per rank: loss, reported_norm, local_norm, norm_ok."""
    mismatches: pd.DataFrame
    """One row per disagreement: rank, tensor, check, detail."""

    @property
    def ok(self) -> bool:
        return self.mismatches.empty

    def to_pandas(self) -> pd.DataFrame:
        return self.units


def grad_norms(reports: Sequence[GradReport], *, rtol: float = 1e-4) -> GradNorms:
    """Combine :func:`grad_report` results (one per rank) and check that ranks agree."""
    pieces = _pieces(reports)
    true_norm = math.sqrt(sum(pieces.values()))
    mismatches = []
    rank_rows = []
    for r in reports:
        local = math.sqrt(sum(e.sumsq for e in r.entries))
        ok = r.global_norm is None or math.isclose(r.global_norm, true_norm, rel_tol=rtol, abs_tol=1e-12)
        rank_rows.append({"rank": r.rank, "loss": r.loss, "reported_norm": r.global_norm, "local_norm": local,
                          "norm_ok": ok})
        if not ok:
            mismatches.append({"rank": r.rank, "tensor": "global_norm", "check": "global norm",
                               "detail": f"reported {r.global_norm:.6g}, true {true_norm:.6g}"})
    mismatches += _loss_mismatches(reports) + _checksum_mismatches(reports)
    return GradNorms(
        global_norm=true_norm,
        units=_unit_table(reports, pieces),
        ranks=pd.DataFrame(rank_rows),
        mismatches=pd.DataFrame(mismatches, columns=["rank", "tensor", "check", "detail"]),
    )


def _pieces(reports: Sequence[GradReport]) -> dict[tuple[str, int], float]:
    """Sum of squares per (parameter, shard): the lowest rank holding a replicated piece speaks for it."""
    out: dict[tuple[str, int], float] = {}
    for r in sorted(reports, key=lambda r: r.rank):
        for e in r.entries:
            out.setdefault((e.name, e.shard_index), e.sumsq)
    return out


def _unit_table(reports: Sequence[GradReport], pieces: dict[tuple[str, int], float]) -> pd.DataFrame:
    unit_of = {e.name: unit_label(e.unit) for e in reports[0].entries}
    rows: dict[str, dict] = {}
    for r in reports:
        for e in r.entries:
            row = rows.setdefault(unit_label(e.unit), {"unit": unit_label(e.unit)})
            row[f"rank{r.rank}"] = row.get(f"rank{r.rank}", 0.0) + e.sumsq
    for (name, _), sumsq in pieces.items():
        row = rows[unit_of[name]]
        row["global"] = row.get("global", 0.0) + sumsq
    table = pd.DataFrame(list(rows.values()))
    numeric = [c for c in table.columns if c != "unit"]
    table[numeric] = table[numeric] ** 0.5
    return table


def _loss_mismatches(reports: Sequence[GradReport], rtol: float = 1e-5) -> list[dict]:
    """Ranks whose loss is not close to the loss most ranks share (ties: the lowest rank's)."""
    losses = {r.rank: r.loss for r in reports if r.loss is not None}

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)

    support = {rank: sum(close(v, w) for w in losses.values()) for rank, v in sorted(losses.items())}
    if not support:
        return []
    reference = losses[max(support, key=lambda rank: support[rank])]
    return [{"rank": rank, "tensor": "loss", "check": "loss",
             "detail": f"{v:.6g} where the other ranks have {reference:.6g}"}
            for rank, v in sorted(losses.items()) if not close(v, reference)]


def _checksum_mismatches(reports: Sequence[GradReport]) -> list[dict]:
    out = []
    for key in sorted({k for r in reports for k in r.checksums}):
        values = {r.rank: r.checksums[key] for r in reports if key in r.checksums}
        if len(values) < 2:
            continue
        reference, odd = outliers(values)
        agree = min(rank for rank, v in values.items() if v == reference)
        kind, name = key.split(":", 1)
        for rank in odd:
            out.append({"rank": rank, "tensor": name, "check": f"replicated {kind}",
                        "detail": f"this rank's {kind} differs from rank {agree}'s"})
    return out
