"""Does per-rank training state shrink as 1/N? Parameters, gradients and optimizer state per rank vs the whole model."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from rlkit.diagnostics.inspection import RankReport
from rlkit.diagnostics.memory import MiB

KINDS = ("parameters", "gradients", "optimizer")


def rank_state_bytes(report: RankReport) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state (tensors an optimizer holds beyond the model included)."""
    return {
        "parameters": sum(p.local_bytes for p in report.params),
        "gradients": sum(p.grad_bytes for p in report.params),
        "optimizer": sum(p.optim_bytes for p in report.params) + _foreign_bytes(report),
    }


def whole_state_bytes(reports: Sequence[RankReport]) -> dict[str, int]:
    """The same state on one rank holding everything: each (parameter, shard) counted once across ranks."""
    seen: dict[tuple[str, int], tuple[int, int, int]] = {}
    for report in reports:
        for p in report.params:
            seen.setdefault((p.name, p.shard_index), (p.local_bytes, p.grad_bytes, p.optim_bytes))
    return {
        "parameters": sum(v[0] for v in seen.values()),
        "gradients": sum(v[1] for v in seen.values()),
        "optimizer": sum(v[2] for v in seen.values()) + _foreign_bytes(reports[0]),
    }


def _foreign_bytes(report: RankReport) -> int:
    """Tensors an optimizer steps that are not the model's (and their state): every rank holds them whole."""
    opt = report.optimizer
    return 0 if opt is None else opt.foreign_state_bytes + sum(t.bytes for t in opt.foreign)


def memory_scaling(*runs: Sequence[RankReport]) -> pd.DataFrame:
    """Per-rank state at each world size against the ideal 1/N of the whole model.

    Pass one or more runs (each the list of per-rank reports of one world size).
    The first row is the whole model on one rank, computed from the first run;
    ``vs_ideal`` is the largest rank's state over the whole model / N (1.0 is
    perfect sharding, N means nothing was sharded).
    """
    whole = whole_state_bytes(runs[0])
    total = sum(whole.values())
    rows = [{"world_size": 1, "source": "whole model", **{f"{k}_mb": v / MiB for k, v in whole.items()},
             "per_rank_mb": total / MiB, "ideal_mb": total / MiB, "vs_ideal": 1.0}]
    for reports in runs:
        n = reports[0].world_size
        per_rank = [rank_state_bytes(r) for r in reports]
        worst = max(per_rank, key=lambda b: sum(b.values()))
        rows.append({
            "world_size": n,
            "source": "measured",
            **{f"{k}_mb": worst[k] / MiB for k in KINDS},
            "per_rank_mb": sum(worst.values()) / MiB,
            "ideal_mb": total / n / MiB,
            "vs_ideal": sum(worst.values()) / max(total / n, 1),
        })
    return pd.DataFrame(rows)
