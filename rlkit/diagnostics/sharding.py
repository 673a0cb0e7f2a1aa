"""The sharding layout of all ranks as tables: parameters, units, totals per rank, unwrapped parameters, scaling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import pandas as pd

from rlkit.diagnostics.inspection import RankReport
from rlkit.diagnostics.layout import unit_label
from rlkit.diagnostics.memory import MiB
from rlkit.diagnostics.scaling import memory_scaling, rank_state_bytes


@dataclass
class Sharding:
    """What every rank holds. ``to_pandas()`` is :attr:`params`."""

    params: pd.DataFrame
    """One row per rank and parameter: global and local shape, dtype, local bytes, device, unit, replaced."""
    units: pd.DataFrame
    """One row per FSDP unit: its settings, then ``rank{r}_mb``, the storage each rank holds for it."""
    totals: pd.DataFrame
    """One row per rank and role (the model, then each of ``others``): tensors, MiB (``trained_mb``: the model's
    parameters that train, with LoRA its adapters; the rest is frozen), dtypes, devices."""
    unwrapped: list[str]
    """Parameters no FSDP unit manages: every rank holds them whole."""
    scaling: pd.DataFrame
    """Per-rank training state against the ideal 1/N of the whole model (see :func:`memory_scaling`)."""

    def to_pandas(self) -> pd.DataFrame:
        return self.params


def sharding(reports: Sequence[RankReport]) -> Sharding:
    """Combine :func:`rlkit.diagnostics.inspect` reports (one per rank) into tables."""
    params = pd.DataFrame([{"rank": r.rank, **asdict(p)} for r in reports for p in r.params])
    return Sharding(params=params, units=_units(reports), totals=_totals(reports),
                    unwrapped=[p.name for p in reports[0].params if p.unit is None], scaling=memory_scaling(reports))


def _units(reports: Sequence[RankReport]) -> pd.DataFrame:
    rows = []
    for i, unit in enumerate(reports[0].units):
        row = {k: v for k, v in asdict(unit).items() if k != "local_bytes"}
        row["name"] = unit_label(unit.name)
        row.update({f"rank{r.rank}_mb": r.units[i].local_bytes / MiB for r in reports})
        rows.append(row)
    return pd.DataFrame(rows)


def _totals(reports: Sequence[RankReport]) -> pd.DataFrame:
    rows = []
    for r in reports:
        state = rank_state_bytes(r)
        for h in r.holdings:
            model = h.role == "model"
            rows.append({
                "rank": r.rank,
                "role": h.role,
                "tensors": h.tensors,
                "parameters_mb": h.bytes / MiB,
                "trained_mb": sum(p.local_bytes for p in r.params if p.requires_grad) / MiB if model else 0.0,
                "gradients_mb": state["gradients"] / MiB if model else 0.0,
                "optimizer_mb": state["optimizer"] / MiB if model else 0.0,
                "dtypes": ",".join(h.dtypes),
                "devices": ",".join(h.devices),
                "sharded": h.sharded,
            })
    return pd.DataFrame(rows)
