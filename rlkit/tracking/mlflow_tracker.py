"""MLflow: a run in ``MLFLOW_TRACKING_URI`` if set, else a local file store ``<run_dir>/mlruns``.

mlflow-skinny is enough. MLflow 3 keeps its file store only on request, so for the local store
``MLFLOW_ALLOW_FILE_STORE=true`` is set in this process (unless already set); view it with
``mlflow ui --backend-store-uri <run_dir>/mlruns`` (the full ``mlflow`` package).
The experiment is ``MLFLOW_EXPERIMENT_NAME`` or "rlkit".
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit.tracking.base import flatten_config, numeric_metrics, plain_table

BATCH = 100
"""Params or metrics per request (MLflow's limit for params in one log_batch)."""
_INVALID = re.compile(r"[^\w/.\- :]")


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: characters outside ``[\\w/.\\- :]`` become ``_``
    (``val/reward/pass@4`` -> ``val/reward/pass_4``)."""
    return _INVALID.sub("_", key)


class MlflowTracker:
    """Metrics per step, the flattened config as params, samples as a JSON table artifact per step."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, resume: bool = False):
        """``resume``: log into the experiment's latest run named ``run_name`` (a resumed training), if there is one."""
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlkit")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        earlier = self._client.search_runs(
            [experiment_id], filter_string=f"attributes.run_name = '{run_name}'", order_by=["start_time DESC"]
        ) if resume else []  # fmt: skip
        if earlier:
            self.run_id = earlier[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + BATCH])

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(mlflow_key(k), v, now, step) for k, v in numeric_metrics(metrics).items()]
        for i in range(0, len(rows), BATCH):
            self._client.log_batch(self.run_id, metrics=rows[i : i + BATCH])

    def log_samples(self, step: int, samples: pd.DataFrame) -> None:
        self._client.log_table(self.run_id, data=plain_table(samples), artifact_file=f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
