"""The Tracker protocol every backend implements, and the conversions they share."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import pandas as pd


class Tracker(Protocol):
    """An experiment tracker: the run's config once, every metric per step, sample completions as tables."""

    name: str

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's config (nested plain data, e.g. ``RLConfig.to_dict()``) as hyperparameters."""

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one history row at ``step``; non-numeric values (and ``step`` itself) are left out."""

    def log_samples(self, step: int, samples: pd.DataFrame) -> None:
        """Record a table of sample completions (one row per sample) at ``step``."""

    def close(self) -> None:
        """Write out everything and end the run."""


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested config -> ``{"rollout.temperature": 1.0, ...}``; lists and None become their JSON text."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flatten_config(value, f"{name}.")
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The real-valued entries of a history row as floats (NaN kept; ``step``, strings and None left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, numbers.Real) and not (isinstance(v, float) and math.isinf(v))
    }


def plain_table(samples: pd.DataFrame) -> pd.DataFrame:
    """``samples`` with every cell a number or a string (tensors and lists become text), for any tracker's table."""

    def cell(v: Any) -> Any:
        return v if isinstance(v, bool | int | float | str) else str(v.tolist() if hasattr(v, "tolist") else v)

    return samples.map(cell)
