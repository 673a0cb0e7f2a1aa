"""Weights & Biases: a run in ``<run_dir>/wandb``; ``WANDB_MODE=offline`` keeps it there (``wandb sync`` later).

The project is ``WANDB_PROJECT`` or "rlkit"; online mode needs ``wandb login`` (or ``WANDB_API_KEY``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit.tracking.base import numeric_metrics, plain_table


class WandbTracker:
    """Metrics per step (``/`` in names makes W&B's sections), the config, samples as a ``wandb.Table``."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlkit"),
            dir=str(run_dir),
            name=run_name,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )

    @property
    def run_dir(self) -> Path:
        """The run's own folder (``wandb/offline-run-...`` or ``wandb/run-...``)."""
        return Path(self._run.dir).parent

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(numeric_metrics(metrics), step=step)

    def log_samples(self, step: int, samples: pd.DataFrame) -> None:
        self._run.log({"samples": self._wandb.Table(dataframe=plain_table(samples))}, step=step)

    def close(self) -> None:
        self._run.finish()
