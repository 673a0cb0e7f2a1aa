"""Training curves from ``trainer.history``: reward, KL, response length and seconds per phase, by step."""

from __future__ import annotations

import pandas as pd

from rlkit.widgets.view import View, table_html, table_text

SHOWN = [
    "step",
    "reward/mean",
    "reward/std",
    "kl/mean",
    "actor/loss",
    "actor/grad_norm",
    "response/length/mean",
    "time/step",
]


def reward_figure(history: pd.DataFrame):
    """A plotly figure of mean reward (and its std band) per step."""
    import plotly.graph_objects as go

    x, mean, std = history["step"], history["reward/mean"], history["reward/std"]
    fig = go.Figure(
        [
            go.Scatter(x=x, y=mean + std, line={"width": 0}, showlegend=False, hoverinfo="skip"),
            go.Scatter(x=x, y=(mean - std).clip(lower=0), fill="tonexty", line={"width": 0}, name="± std"),
            go.Scatter(x=x, y=mean, mode="lines+markers", name="mean reward"),
        ]
    )
    fig.update_layout(title="reward", xaxis_title="step", yaxis_title="reward", height=320, margin={"t": 40})
    return fig


def phases_figure(history: pd.DataFrame):
    """KL to the reference, mean response length, and controller seconds per phase (stacked), by step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("KL to reference", "response length", "seconds per phase"))
    x = history["step"]
    fig.add_trace(go.Scatter(x=x, y=history["kl/mean"], name="kl/mean", mode="lines+markers"), row=1, col=1)
    fig.add_trace(
        go.Scatter(x=x, y=history["response/length/mean"], name="length/mean", mode="lines+markers"), row=1, col=2
    )
    for column in [c for c in history.columns if c.startswith("time/") and c.count("/") == 1 and c != "time/step"]:
        fig.add_trace(go.Bar(x=x, y=history[column], name=column.removeprefix("time/")), row=1, col=3)
    fig.update_layout(title="training", barmode="stack", height=320, margin={"t": 60})
    return fig


class TrainingView(View):
    """Curves of ``trainer.history`` (one row per step) and its last rows."""

    title = "training"

    def __init__(self, history: pd.DataFrame):
        self.history = history

    @classmethod
    def from_trainer(cls, trainer) -> TrainingView:
        return cls(trainer.history)

    def update(self, history: pd.DataFrame) -> None:
        self.history = history
        self.refresh()

    def figures(self) -> list:
        if self.history.empty:
            return []
        return [reward_figure(self.history), phases_figure(self.history)]

    def _last(self) -> pd.DataFrame:
        return self.history[[c for c in SHOWN if c in self.history.columns]].tail(5)

    def summary_html(self) -> str:
        if self.history.empty:
            return '<p class="note">no step yet</p>'
        return table_html(self._last())

    def summary_text(self) -> str:
        if self.history.empty:
            return "training: no step yet"
        return f"training: {len(self.history)} step(s)\n{table_text(self._last())}"
