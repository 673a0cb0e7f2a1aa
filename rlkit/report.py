"""A self-contained HTML report of a run (plotly inlined: opens offline, no CDN)."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd


def write_report(history: pd.DataFrame, path: str | Path, *, title: str, config: dict) -> Path:
    """Write reward, KL, length and phase-time curves plus the config to one HTML file; returns its path."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=("mean reward", "KL to reference / approx", "response length", "seconds per phase"),
    )
    x = history["step"]
    fig.add_trace(go.Scatter(x=x, y=history["reward/mean"], name="reward/mean", mode="lines+markers"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=history["kl/mean"], name="kl/mean"), row=1, col=2)
    fig.add_trace(go.Scatter(x=x, y=history["response/length/mean"], name="length/mean"), row=2, col=1)
    for column in [c for c in history.columns if c.startswith("time/") and c.count("/") == 1 and c != "time/step"]:
        fig.add_trace(go.Bar(x=x, y=history[column], name=column), row=2, col=2)
    fig.update_layout(barmode="stack", height=700, title=title)
    body = fig.to_html(full_html=False, include_plotlyjs=True)
    last = history.tail(1).T.rename(columns=lambda _: "last step").to_html(float_format="{:.4g}".format)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{padding:2px 8px}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
{body}
<h2>Last step</h2>{last}
<h2>Config</h2><pre>{html.escape(json.dumps(config, indent=2))}</pre>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
