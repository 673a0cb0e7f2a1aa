"""TensorBoard: event files under ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit.tracking.base import flatten_config, numeric_metrics, plain_table


class TensorBoardTracker:
    """Scalars per metric and step, the config in the HParams tab and as text, samples as a markdown table."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        """``purge_step``: a resumed run's first step; TensorBoard hides the events of that step and later that an
        earlier process wrote into ``log_dir`` (the same run continues: one run, steps continuing)."""
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self._writer._get_file_writer()
        for summary in hparams(flatten_config(config), {}):
            writer.add_summary(summary)
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in numeric_metrics(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_samples(self, step: int, samples: pd.DataFrame) -> None:
        self._writer.add_text("samples", markdown_table(plain_table(samples)), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def markdown_table(table: pd.DataFrame) -> str:
    """A markdown table (TensorBoard's text tab renders it); ``|`` and newlines in cells are escaped."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)
