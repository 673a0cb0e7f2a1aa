"""MemoryView: per-rank memory at each phase boundary, stacked by what holds it, across steps, and against 1/N."""

from __future__ import annotations

import pandas as pd

from rlkit.widgets.view import View, table_html, table_text

CATEGORIES = ["parameters", "gradients", "optimizer", "engine", "other"]
COLORS = {
    "parameters": "#4c78a8",
    "gradients": "#f58518",
    "optimizer": "#54a24b",
    "engine": "#b279a2",
    "other": "#bab0ac",
}


class MemoryView(View):
    """Memory marks of every rank (:func:`rlkit.diagnostics.memory_table`, with a ``step`` column when several
    steps were recorded) and, optionally, the 1/N scaling table (``trainer.sharding().scaling``).

    The total is CUDA allocated memory on GPU and process RSS on CPU; "other" is the total minus the parameters,
    gradients, optimizer state and rollout engine counted in it.
    """

    title = "memory"

    def __init__(self, marks: pd.DataFrame, scaling: pd.DataFrame | None = None):
        self.marks = marks
        self.scaling = scaling

    @classmethod
    def from_trainer(cls, trainer) -> MemoryView:
        return cls(trainer.memory().assign(step=trainer.steps_done), trainer.sharding().scaling)

    def update(self, marks: pd.DataFrame, scaling: pd.DataFrame | None = None) -> None:
        self.marks = marks
        if scaling is not None:
            self.scaling = scaling
        self.refresh()

    def table(self) -> pd.DataFrame:
        """The marks with ``step`` (0 when not recorded) and ``total_mb`` (allocated, or RSS where NaN)."""
        marks = self.marks if "step" in self.marks.columns else self.marks.assign(step=0)
        return marks.assign(total_mb=marks["allocated_mb"].fillna(marks["rss_mb"]))

    def latest(self) -> pd.DataFrame:
        """The marks of the last recorded step."""
        table = self.table()
        return table[table["step"] == table["step"].max()]

    def figures(self) -> list:
        figures = [] if self.marks.empty else [self._by_phase(), self._across_steps()]
        if self.scaling is not None and not self.scaling.empty:
            figures.append(self._scaling())
        return figures

    def _by_phase(self):
        import plotly.graph_objects as go

        latest = self.latest()
        x = [[f"rank {r}" for r in latest["rank"]], list(latest["phase"])]
        fig = go.Figure([go.Bar(x=x, y=latest[f"{c}_mb"], name=c, marker_color=COLORS[c]) for c in CATEGORIES])
        where = "" if latest["allocated_mb"].notna().any() else "; on CPU the total is process RSS"
        fig.update_layout(
            barmode="stack",
            title=f"MiB by phase and what holds it (step {latest['step'].max()}{where})",
            yaxis_title="MiB",
            height=360,
            margin={"t": 40},
        )
        return fig

    def _across_steps(self):
        import plotly.graph_objects as go

        table = self.table()
        fig = go.Figure()
        for rank, rows in table.groupby("rank"):
            x = [f"{s}:{p}" for s, p in zip(rows["step"], rows["phase"], strict=True)]
            fig.add_trace(go.Scatter(x=x, y=rows["total_mb"], name=f"rank {rank}", mode="lines+markers"))
            if rows["peak_mb"].notna().any():
                fig.add_trace(go.Scatter(x=x, y=rows["peak_mb"], name=f"rank {rank} peak", line={"dash": "dot"}))
        fig.update_layout(
            title="total MiB per rank at each phase boundary (step:phase)",
            yaxis_title="MiB",
            height=320,
            margin={"t": 40},
        )
        return fig

    def _scaling(self):
        import plotly.graph_objects as go

        s = self.scaling
        x = [
            "1 (whole model)" if src == "whole model" else f"{n} ranks"
            for n, src in zip(s["world_size"], s["source"], strict=True)
        ]
        fig = go.Figure(
            [
                go.Bar(x=x, y=s[f"{c}_mb"], name=c, marker_color=COLORS[c])
                for c in ("parameters", "gradients", "optimizer")
            ]
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=s["ideal_mb"],
                name="ideal 1/N",
                mode="lines+markers+text",
                line={"color": "black", "dash": "dash"},
                text=[f"vs ideal {v:.2f}" for v in s["vs_ideal"]],
                textposition="top center",
            )
        )
        fig.update_layout(
            barmode="stack",
            title="training state per rank (largest rank) against the ideal 1/N",
            yaxis_title="MiB",
            height=320,
            margin={"t": 40},
        )
        return fig

    def _summary(self) -> pd.DataFrame:
        return self.latest()[["rank", "phase", "total_mb", *[f"{c}_mb" for c in CATEGORIES]]]

    def summary_html(self) -> str:
        if self.marks.empty:
            return '<p class="note">no memory marks yet (they are taken during a step)</p>'
        peak = self.table().groupby("rank")["total_mb"].max()
        parts = [
            f"<p>Highest total per rank: {', '.join(f'rank {r}: {v:.4g} MiB' for r, v in peak.items())}</p>",
            table_html(self._summary()),
        ]
        if self.scaling is not None and not self.scaling.empty:
            parts.append("<p>Training state per rank against the ideal 1/N</p>" + table_html(self.scaling))
        return "".join(parts)

    def summary_text(self) -> str:
        if self.marks.empty:
            return "memory: no marks yet"
        text = f"memory (MiB) at step {self.latest()['step'].max()}:\n{table_text(self._summary())}"
        if self.scaling is not None and not self.scaling.empty:
            text += "\n" + table_text(self.scaling[["world_size", "source", "per_rank_mb", "ideal_mb", "vs_ideal"]])
        return text
