"""ShardingView: what each rank holds of each FSDP unit (units x ranks), with parameters no unit wrapped highlighted."""

from __future__ import annotations

import html

import pandas as pd

from rlkit.diagnostics import Sharding
from rlkit.diagnostics.layout import unit_label
from rlkit.diagnostics.memory import MiB
from rlkit.widgets.view import View, table_html, table_text

UNWRAPPED = unit_label(None)
HOVER_PARAMS = 12  # parameters listed in one cell's hover text
UNIT_COLUMNS = [
    "name",
    "api",
    "strategy",
    "shard_size",
    "replicate_size",
    "param_dtype",
    "reshard_after_forward",
    "params",
    "numel",
]


class ShardingView(View):
    """A heatmap of MiB per unit (rows) and rank (columns); hover names each parameter's global and local shape.

    Parameters that no FSDP unit manages form the row "(unwrapped)", outlined in red: every rank holds them whole.
    """

    title = "sharding"

    def __init__(self, sharding: Sharding):
        self.sharding = sharding

    @classmethod
    def from_trainer(cls, trainer) -> ShardingView:
        return cls(trainer.sharding())

    def update(self, sharding: Sharding) -> None:
        self.sharding = sharding
        self.refresh()

    @property
    def ranks(self) -> list[int]:
        return sorted(self.sharding.params["rank"].unique())

    def grid(self) -> pd.DataFrame:
        """MiB each rank holds, one row per unit (index: unit label), one column per rank; "(unwrapped)" last."""
        units = self.sharding.units
        if units.empty:  # no FSDP unit at all
            grid = pd.DataFrame(columns=self.ranks, dtype=float)
        else:
            grid = pd.DataFrame({r: units[f"rank{r}_mb"].to_numpy() for r in self.ranks}, index=units["name"].tolist())
        if self.sharding.unwrapped:
            params = self.sharding.params
            loose = params[params["unit"].isna()].groupby("rank")["local_bytes"].sum() / MiB
            grid.loc[UNWRAPPED] = [loose.get(r, 0.0) for r in self.ranks]
        return grid

    def hover(self) -> list[list[str]]:
        """Hover text per grid cell: the unit, the rank, and its parameters' global -> local shapes and bytes."""
        units = self.sharding.params["unit"]
        params = self.sharding.params.assign(label=[unit_label(u if isinstance(u, str) else None) for u in units])
        by_cell = {key: rows for key, rows in params.groupby(["label", "rank"])}
        grid = self.grid()
        text = []
        for unit in grid.index:
            row = []
            for r in grid.columns:
                lines = [f"<b>{html.escape(unit)}</b> on rank {r}: {grid.loc[unit, r]:.4g} MiB"]
                rows = by_cell.get((unit, r), params.iloc[:0])
                for p in rows.head(HOVER_PARAMS).itertuples():
                    lines.append(
                        f"{html.escape(p.name)}: {tuple(p.global_shape)} -> {tuple(p.local_shape)} "
                        f"{p.dtype}, {p.local_bytes:,} B"
                    )
                if len(rows) > HOVER_PARAMS:
                    lines.append(f"... {len(rows) - HOVER_PARAMS} more")
                row.append("<br>".join(lines))
            text.append(row)
        return text

    def figures(self) -> list:
        import plotly.graph_objects as go

        grid = self.grid()
        fig = go.Figure(
            go.Heatmap(
                z=grid.to_numpy(),
                x=[f"rank {r}" for r in grid.columns],
                y=list(grid.index),
                text=self.hover(),
                hoverinfo="text",
                texttemplate="%{z:.3g}",
                colorscale="Blues",
                colorbar={"title": {"text": "MiB"}},
            )
        )
        if UNWRAPPED in grid.index:
            row = list(grid.index).index(UNWRAPPED)
            fig.add_shape(
                type="rect", xref="paper", x0=0, x1=1, y0=row - 0.5, y1=row + 0.5, line={"color": "red", "width": 3}
            )
            fig.add_annotation(
                xref="paper",
                x=1,
                y=row,
                xanchor="left",
                showarrow=False,
                font={"color": "red"},
                text=f"{len(self.sharding.unwrapped)} unwrapped: whole on every rank",
            )
        fig.update_yaxes(autorange="reversed")
        fig.update_layout(
            title="MiB per FSDP unit and rank", height=max(260, 60 + 28 * len(grid)), margin={"t": 40, "r": 220}
        )
        return [fig]

    def _unwrapped_note(self) -> str:
        names = self.sharding.unwrapped
        return f"{len(names)} parameter(s) no FSDP unit manages (every rank holds them whole): {', '.join(names)}"

    def summary_html(self) -> str:
        units = self.sharding.units
        parts = []
        if self.sharding.unwrapped:
            parts.append(f'<p class="flag">{html.escape(self._unwrapped_note())}</p>')
        parts.append(table_html(units[[c for c in units.columns if c in UNIT_COLUMNS or c.endswith("_mb")]]))
        parts.append("<p>Per rank and role</p>" + table_html(self.sharding.totals))
        parts.append(
            "<p>Training state per rank against the ideal 1/N (vs_ideal 1.0 is perfect)</p>"
            + table_html(self.sharding.scaling)
        )
        return "".join(parts)

    def summary_text(self) -> str:
        grid = self.grid()
        lines = [
            f"sharding: {len(self.sharding.units)} FSDP unit(s) over {len(self.ranks)} rank(s); MiB per unit and rank:",
            grid.rename(columns=lambda r: f"rank{r}").to_string(float_format=lambda v: f"{v:.4g}"),
        ]
        if self.sharding.unwrapped:
            lines.append(self._unwrapped_note())
        lines.append(table_text(self.sharding.scaling[["world_size", "source", "per_rank_mb", "ideal_mb", "vs_ideal"]]))
        return "\n".join(lines)
