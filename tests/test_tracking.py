"""Experiment trackers, checked by reading back what each wrote: TensorBoard's event reader, the W&B offline
run file, MLflow's client on the local file store."""

from __future__ import annotations

import glob
import json
import math
import struct
import time

import pandas as pd
import pytest
import torch

from rlkit.config import ConfigError
from rlkit.tracking import build_trackers, flatten_config, numeric_metrics

CONFIG = {"algorithm": "grpo", "seed": 3, "rollout": {"temperature": 0.7, "engine": "hf"}, "trackers": ["x"]}
HISTORY = [{"step": s, "reward/mean": 0.1 * s, "val/reward/pass@2": 0.5, "note": "text"} for s in range(1, 4)]
SAMPLES = pd.DataFrame({"prompt": ["1+1=", "2|2="], "completion": ["2", "4\nok"], "reward": [1.0, 0.0],
                        "ids": [torch.tensor([1, 2]), [3]]})


def run(names, run_dir):
    trackers = build_trackers(names, run_dir, CONFIG)
    for row in HISTORY:
        for tracker in trackers:
            tracker.log_metrics(row["step"], row)
    for tracker in trackers:
        tracker.log_samples(3, SAMPLES)
        tracker.close()
    return trackers


def test_conversions():
    assert flatten_config(CONFIG) == {"algorithm": "grpo", "seed": 3, "rollout.temperature": 0.7,
                                      "rollout.engine": "hf", "trackers": '["x"]'}
    got = numeric_metrics({"step": 2, "a": 1, "b": float("nan"), "c": "x", "d": None, "e": float("inf")})
    assert list(got) == ["a", "b"] and math.isnan(got["b"])


def test_unknown_or_uninstalled_trackers_fail_before_anything_is_written(tmp_path, monkeypatch):
    import rlkit.config.installed as installed

    monkeypatch.setattr(installed.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        build_trackers(["tensorboard", "neptune"], tmp_path / "run", CONFIG)
    assert err.value.problems[0].startswith("trackers=['tensorboard', 'neptune']: unknown ['neptune']")
    assert err.value.problems[1] == 'trackers: "tensorboard" needs its package: pip install "rlkit[tensorboard]"'
    assert not (tmp_path / "run").exists()


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from tensorboard.util.tensor_util import make_ndarray

    run(["tensorboard"], tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in events.Scalars("val/reward/pass@2")] == [0.5] * 3
    assert "note" not in events.Tags()["scalars"] and "step" not in events.Tags()["scalars"]
    (sample,) = events.Tensors("samples/text_summary")
    table = make_ndarray(sample.tensor_proto).item().decode()
    assert sample.step == 3 and "| prompt | completion | reward | ids |" in table
    assert "| 2\\|2= | 4<br>ok | 0.0 | [3] |" in table and "| 1+1= | 2 | 1.0 | [1, 2] |" in table
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["rollout.temperature"].number_value == pytest.approx(0.7)
    assert hparams["rollout.engine"].string_value == "hf"


def wandb_records(path):
    """The records of a W&B run file (a LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            yield wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""


def finished_wandb_records(path, timeout=60.0):
    """The run file's records once it holds its exit record: wandb-core's writer may still be flushing the file
    after ``run.finish()`` has returned (seen under load: a file of only its 7-byte header)."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tracker,) = run(["wandb"], tmp_path)
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = [], {}
    for record in finished_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config |= {i.key: json.loads(i.value_json) for i in items}
    assert [h["_step"] for h in history] == [1, 2, 3]  # the samples join step 3's row
    assert [h["reward/mean"] for h in history] == pytest.approx([0.1, 0.2, 0.3])
    assert [h["val/reward/pass@2"] for h in history] == [0.5] * 3 and "note" not in history[0]
    assert history[2]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 2
    assert config["rollout"] == {"temperature": 0.7, "engine": "hf"} and config["seed"] == 3
    (table,) = glob.glob(str(tracker.run_dir / "files" / "media" / "table" / "samples_*.table.json"))
    saved = json.load(open(table))
    assert saved["columns"] == ["prompt", "completion", "reward", "ids"]
    assert saved["data"] == [["1+1=", "2", 1.0, "[1, 2]"], ["2|2=", "4\nok", 0.0, "[3]"]]


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (tracker,) = run(["mlflow"], tmp_path)
    assert tracker.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(tracker.tracking_uri)
    got = client.get_run(tracker.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["rollout.temperature"] == "0.7" and got.data.params["seed"] == "3"
    history = client.get_metric_history(tracker.run_id, "reward/mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [m.value for m in client.get_metric_history(tracker.run_id, "val/reward/pass_2")] == [0.5] * 3
    local = client.download_artifacts(tracker.run_id, "samples/step_000003.json", str(tmp_path / "dl"))
    saved = json.load(open(local))
    assert saved["columns"] == ["prompt", "completion", "reward", "ids"]
    assert saved["data"] == [["1+1=", "2", 1.0, "[1, 2]"], ["2|2=", "4\nok", 0.0, "[3]"]]


def test_all_three_at_once(tmp_path, monkeypatch):
    for package in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(package)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    trackers = run(["tensorboard", "wandb", "mlflow"], tmp_path / "run")
    assert [t.name for t in trackers] == ["tensorboard", "wandb", "mlflow"]
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"tensorboard", "wandb", "mlruns"}


def test_a_resumed_training_continues_the_folders_tensorboard_and_mlflow_runs(tmp_path, monkeypatch):
    """Steps 1-3 logged, the process killed after its checkpoint of step 2, the resumed one logs 3 and 4: one
    TensorBoard run (step 3 as logged again) and one MLflow run with every step."""
    for package in ("tensorboard", "mlflow"):
        pytest.importorskip(package)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    first = build_trackers(["tensorboard", "mlflow"], tmp_path, CONFIG)
    for step in (1, 2, 3):
        for tracker in first:
            tracker.log_metrics(step, {"reward/mean": float(step)})
    resumed = build_trackers(["tensorboard", "mlflow"], tmp_path, CONFIG, first_step=3)
    for step in (3, 4):
        for tracker in resumed:
            tracker.log_metrics(step, {"reward/mean": 10.0 * step})
    for tracker in first + resumed:
        tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert resumed[1].run_id == first[1].run_id
    history = MlflowClient(first[1].tracking_uri).get_metric_history(first[1].run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 3, 4]  # MLflow keeps both values of step 3
