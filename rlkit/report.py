"""A self-contained HTML report of a run (plotly inlined: opens offline, no CDN)."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

RL_PANELS = (
    ("mean reward", ("reward/mean",)),
    ("KL to reference / approx", ("kl/mean",)),
    ("response length", ("response/length/mean",)),
)
"""The line panels of an RL run's report, each (title, history columns)."""
PREFERENCE_PANELS = (
    ("preference accuracy", ("rewards/accuracy",)),
    ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    ("loss and gradient norm", ("actor/loss", "actor/grad_norm")),
)
"""The line panels of a DPO or KTO run's report (a history with rewards/accuracy)."""


def write_report(
    history: pd.DataFrame,
    path: str | Path,
    *,
    title: str,
    config: dict,
    samples: Mapping[int, pd.DataFrame] | None = None,
) -> Path:
    """Write the run's curves (RL: reward, KL, length; DPO/KTO: accuracy, implicit rewards, loss and gradient
    norm) and seconds per phase, sample completions of some steps (``samples``: a table per step, e.g. the first
    and the last), the last step's metrics and the config to one HTML file; returns its path."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = PREFERENCE_PANELS if "rewards/accuracy" in history else RL_PANELS
    fig = make_subplots(rows=2, cols=2, subplot_titles=[name for name, _ in panels] + ["seconds per phase"])
    history = history[history["step"] > 0] if (history["step"] == 0).any() else history  # step 0: validation only
    x = history["step"]
    for i, (_, columns) in enumerate(panels):
        for column in columns:
            line = go.Scatter(x=x, y=history[column], name=column, mode="lines+markers")
            fig.add_trace(line, row=1 + i // 2, col=1 + i % 2)
    phases = [c for c in history.columns if c.startswith("time/") and c.count("/") == 1 and c != "time/step"]
    for column in phases or [c for c in history.columns if c.startswith("time/worker/")]:
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
{_samples_html(samples or {})}
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


SAMPLE_ROWS = 8
"""Samples shown per step; their text is cut at SAMPLE_CHARS characters."""
SAMPLE_CHARS = 300


def _samples_html(samples: Mapping[int, pd.DataFrame]) -> str:
    """A table per step: the text columns and the rewards of its first SAMPLE_ROWS samples (a multi-turn run's
    whole conversation after the prompt, a message per line, instead of its last turn)."""
    parts = []
    for step, table in samples.items():
        text = [c for c in ("prompt", "completion", "chosen", "rejected", "label") if c in table]
        numbers = [c for c in table if c == "reward" or c.startswith("reward/") or c == "advantage"]
        shown = table[text + numbers].head(SAMPLE_ROWS).map(_cut)
        if "messages" in table:
            shown["completion"] = [_conversation(m) for m in table["messages"].head(SAMPLE_ROWS)]
        cells = shown.map(lambda v: html.escape(v).replace("\n", "<br>") if isinstance(v, str) else v)
        rows = cells.to_html(index=False, escape=False, float_format="{:.3f}".format)
        parts.append(f"<h3>Step {step} ({len(table)} samples, the first {len(shown)} shown)</h3>{rows}")
    return "<h2>Samples</h2>" + "".join(parts) if parts else ""


def _cut(value: Any) -> Any:
    return value if not isinstance(value, str) or len(value) <= SAMPLE_CHARS else value[:SAMPLE_CHARS] + "..."


def _conversation(messages: list[dict[str, Any]]) -> str:
    """A trajectory's messages from its first assistant turn on, one "role: content" per line, each cut at
    SAMPLE_CHARS characters."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return "\n".join(_cut(f"{m.get('role')}: {m.get('content')}".replace("\n", " ")) for m in messages[first:])
