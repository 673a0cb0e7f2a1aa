"""What ``rlkit train`` prints per step: a header and one compact line per step, and the summary at the end.

An RL line holds the mean reward and each reward term's mean, the KL to the reference ("-" when it is not
measured: kl_coef = 0), the mean response length, a multi-turn run's turns, tool use, failed calls and
environment errors, tokens/s, the step's seconds with its rollout and update shares, the engine-vs-trainer gap
when the engine returns log-probs, the largest correction weight and the share masked when rollout_correction is
on, and each rank's memory; a DPO/KTO line the preference accuracy, margins, loss, gradient norm, tokens/s,
seconds and memory. The validation reward (DPO/KTO: loss and accuracy) follows on the steps that have it.
Everything else is in history.csv.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rlkit.config import PreferenceConfig, RLConfig


@dataclass(frozen=True)
class Column:
    """One column: its title, the history key it shows and the format of a value ("-" when absent or NaN)."""

    title: str
    key: str
    spec: str
    width: int

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if isinstance(value, float) and math.isnan(value):
            value = None
        return f"{'-' if value is None else format(value, self.spec):>{self.width}}"


@dataclass(frozen=True)
class StepLines:
    """The printed table of a run: :meth:`header`, then :meth:`line` for each history row."""

    columns: Sequence[Column]
    validation: Sequence[tuple[str, str]]
    """(label, history key) of the validation figures appended to the rows that have them."""

    def header(self) -> str:
        return " ".join(f"{c.title:>{c.width}}" for c in self.columns) + "  mem/rank MiB"

    def line(self, row: dict[str, Any]) -> str:
        """One step's line; the row of step 0 (validation before training) shows its figures alone."""
        shown = self.columns if row.get("step") else self.columns[:1]
        text = " ".join(c.cell(row) for c in shown)
        if row.get("step"):
            text += f"  {memory(row)}"
        checked = [f"{label} {row[key]:.3f}" for label, key in self.validation if _number(row.get(key))]
        return text + ("  val: " + ", ".join(checked) if checked else "")


AGENT_COLUMNS = (
    Column("turns", "agent/turns/mean", ".2f", 5),
    Column("tools", "agent/tool_use_frac", ".2f", 5),
    Column("failed", "agent/failed_calls_frac", ".2f", 6),
    Column("env_err", "agent/env_errors", ".0f", 7),
)
"""A multi-turn run's columns: turns per trajectory, the share of trajectories with a call that ran, the share of
calls that failed, and the trajectories whose environment failed."""


def rl_lines(
    terms: Sequence[str], *, agent: bool = False, mismatch: bool = False, correction: bool = False
) -> StepLines:
    """The RL table; ``terms``: the reward terms' names (each gets its column when there are several); ``agent``:
    a multi-turn run (its columns follow the length's); ``mismatch``: the engine returns log-probs (the gap's
    column, mean |trainer - engine| nats per token); ``correction``: rollout_correction is on (the largest weight
    and the share of tokens masked)."""
    named = [Column(_short(t), f"reward/{t}/mean", ".3f", max(6, len(_short(t)))) for t in terms if len(terms) > 1]
    gap = [Column("gap", "mismatch/abs_delta/mean", ".0e", 5)] if mismatch else []
    weights = [Column("w max", "rollout_correction/weight/max", ".2f", 5),
               Column("masked", "rollout_correction/masked_frac", ".3f", 6)] if correction else []  # fmt: skip
    return StepLines(
        columns=[
            Column("step", "step", "d", 4),
            Column("reward", "reward/mean", ".3f", 6),
            *named,
            Column("kl", "kl/mean", ".4f", 6),
            Column("len", "response/length/mean", ".1f", 5),
            *(AGENT_COLUMNS if agent else ()),
            Column("tok/s", "perf/tokens_per_s", ".0f", 6),
            Column("s/step", "time/step", ".1f", 6),
            Column("gen", "time/rollout", ".1f", 5),
            Column("update", "time/update", ".1f", 6),
            *gap,
            *weights,
        ],
        validation=[("reward", "val/reward/mean")],
    )


def loss_phrase(config: RLConfig | PreferenceConfig) -> str:
    """The start line's words on the loss: ", policy_loss=..., rollout_correction ..." for GRPO/PPO (nothing for
    DPO/KTO, whose algorithm names the loss)."""
    if not isinstance(config, RLConfig):
        return ""
    return f", policy_loss={config.policy_loss}, rollout_correction {config.rollout_correction.summary()}"


def preference_lines() -> StepLines:
    """The DPO/KTO table."""
    return StepLines(
        columns=[
            Column("step", "step", "d", 4),
            Column("accuracy", "rewards/accuracy", ".3f", 8),
            Column("margins", "rewards/margins", ".3f", 7),
            Column("loss", "actor/loss", ".4f", 7),
            Column("grad", "actor/grad_norm", ".3f", 6),
            Column("tok/s", "perf/tokens_per_s", ".0f", 6),
            Column("s/step", "time/step", ".1f", 6),
        ],
        validation=[("loss", "val/loss"), ("accuracy", "val/rewards/accuracy")],
    )


def memory(row: dict[str, Any]) -> str:
    """Each rank's memory, "/"-joined: the CUDA peak on GPUs, else the process RSS."""
    cuda = [k for k in sorted(row) if k.startswith("memory/rank") and k.endswith("peak_mb")]
    keys = cuda or [k for k in sorted(row) if k.startswith("memory/rank") and k.endswith("rss_mb")]
    return "/".join(f"{row[k]:.0f}" for k in keys) or "-"


def progress(history: pd.DataFrame, metric: str, label: str) -> str:
    """How ``metric`` moved: the first step's value against the last's, or with 6+ steps the means of the first
    and last 3; one step: its value."""
    values = history.loc[history["step"] > 0, metric].dropna() if metric in history else pd.Series(dtype=float)
    if values.empty:
        return f"{label}: -"
    if len(values) == 1:
        return f"{label} {values.iloc[0]:.3f}"
    if len(values) < 6:
        return f"{label} {values.iloc[0]:.3f} (first step) -> {values.iloc[-1]:.3f} (last)"
    return f"{label} {values.head(3).mean():.3f} (first 3 steps) -> {values.tail(3).mean():.3f} (last 3)"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def _short(name: str, limit: int = 16) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "~"

