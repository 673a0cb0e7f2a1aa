"""What a trainer writes into its run's folder as it goes: ``history.csv`` after every step, ``config.toml``, and
sample tables (``samples/step-<N>.jsonl``), so that a run killed at any point keeps what it did."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit.config import default_output_dir, to_toml

HISTORY = "history.csv"
CONFIG = "config.toml"
SAMPLES = "samples"
CHECKPOINTS = "checkpoints"


def output_folder(config: Any) -> Path | None:
    """The trainer's folder: ``config.output_dir``; unset, the default folder when trackers or periodic checkpoints
    without ``checkpoint.dir`` need one; else None (the trainer writes no files)."""
    if config.output_dir:
        return Path(config.output_dir).absolute()
    if config.trackers or (config.checkpoint.every and not config.checkpoint.dir):
        return default_output_dir(config.algorithm, config.model)
    return None


def checkpoint_folder(config: Any, output_dir: Path | None) -> Path | None:
    """Where ``fit``'s periodic checkpoints go: ``checkpoint.dir``, else ``<output_dir>/checkpoints``."""
    if config.checkpoint.dir:
        return Path(config.checkpoint.dir)
    return None if output_dir is None else output_dir / CHECKPOINTS


class HistoryFile:
    """``history.csv``, kept equal to the history after every change: a step appends one line; a change of the
    columns or of an earlier row (a validation pass merged into its step's row, a resumed history) rewrites it,
    atomically."""

    def __init__(self, path: Path):
        self.path = path
        self._columns: list[str] = []
        self._written = 0

    def update(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Make the file hold ``rows`` (every row so far)."""
        columns = list(dict.fromkeys(k for row in rows for k in row))
        if columns == self._columns and self._written == len(rows) - 1 and self.path.exists():
            with open(self.path, "a", newline="") as f:
                csv.writer(f).writerow([_cell(rows[-1].get(c)) for c in columns])
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            pd.DataFrame(list(rows), columns=columns).to_csv(tmp, index=False)
            os.replace(tmp, self.path)
        self._columns, self._written = columns, len(rows)


def write_config(folder: Path, config: Any) -> Path:
    """``config.toml``: the config as run (``rlkit train folder/config.toml`` runs it again)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONFIG
    path.write_text(to_toml(config.to_dict()), encoding="utf-8")
    return path


def write_samples(folder: Path, step: int, table: pd.DataFrame) -> Path:
    """One step's sample table as ``samples/step-<N>.jsonl`` (a row per completion or example)."""
    path = folder / SAMPLES / f"step-{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = table.map(lambda v: v.tolist() if hasattr(v, "tolist") else v)
    plain.to_json(path, orient="records", lines=True, force_ascii=False)
    return path


def read_samples(folder: Path) -> dict[int, pd.DataFrame]:
    """The sample tables written into ``folder``, by step (empty when none were)."""
    found = sorted((folder / SAMPLES).glob("step-*.jsonl"))
    return {int(p.stem.split("-")[1]): pd.read_json(p, orient="records", lines=True) for p in found}


def _cell(value: Any) -> Any:
    """A value as pandas' to_csv writes it (NaN and None as empty fields)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value
