"""Training curves from ``trainer.history``."""

from __future__ import annotations

import pandas as pd


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
    fig.update_layout(xaxis_title="step", yaxis_title="reward", height=320, margin={"t": 30})
    return fig
