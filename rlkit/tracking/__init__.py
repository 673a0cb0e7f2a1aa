"""Experiment tracking: TensorBoard, Weights & Biases and MLflow behind one small protocol.

``build_trackers(config.trackers, run_dir, config.to_dict())`` makes one tracker per name (each an
optional extra: ``pip install 'rlkit[tensorboard]'``); the trainer then calls ``log_metrics`` with
every history row, ``log_samples`` with rollout tables, and ``close`` at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlkit.config.checks import ConfigError
from rlkit.config.data import trackers_problems
from rlkit.config.installed import tracker_install_problems
from rlkit.tracking.base import Tracker, flatten_config, numeric_metrics, plain_table

logger = logging.getLogger(__name__)

__all__ = ["Tracker", "build_trackers", "flatten_config", "numeric_metrics", "plain_table"]


def build_trackers(
    names: Sequence[str], run_dir: str | Path, config: Mapping[str, Any], *, first_step: int = 1
) -> list[Tracker]:
    """One started tracker per name, writing under ``run_dir``, each given ``config`` as its hyperparameters.

    Layout: ``run_dir/tensorboard`` (event files), ``run_dir/wandb`` (W&B's run folders),
    ``run_dir/mlruns`` (MLflow's file store, unless ``MLFLOW_TRACKING_URI`` names another).
    ``first_step`` > 1 continues the folder's runs (a resumed training): TensorBoard hides what the earlier
    process logged from that step on (it is logged again), MLflow logs into the folder's run; W&B starts a new
    run of the same name (its steps continue).

    Raises:
        ConfigError: unknown names, or trackers whose packages are not installed (with the pip line).
    """
    problems = trackers_problems(list(names)) + tracker_install_problems(list(names))
    if problems:
        raise ConfigError(problems)
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    trackers: list[Tracker] = []
    try:
        for name in names:
            trackers.append(_start(name, root, first_step))
            trackers[-1].log_config(config)
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    logger.info("trackers %s writing under %s", list(names), root)
    return trackers


def _start(name: str, root: Path, first_step: int) -> Tracker:
    resumed = first_step > 1
    if name == "tensorboard":
        from rlkit.tracking.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(root / "tensorboard", purge_step=first_step if resumed else None)
    if name == "wandb":
        from rlkit.tracking.wandb_tracker import WandbTracker

        return WandbTracker(root, root.name)
    from rlkit.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(root, root.name, resume=resumed)
