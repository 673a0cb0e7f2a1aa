"""The [data], [validation], [[rewards]] and trackers settings, and the pre-launch install checks."""

from __future__ import annotations

import sys

import pytest
import torch

from rlkit.config import ConfigError, GRPOConfig, config_from_dict, config_from_toml
from rlkit.config.data import DataConfig, RewardSpec
from rlkit.config.installed import COMPANION_FIX, torch_companion_problems

TOML = """
model = "tiny"
trackers = ["tensorboard", "mlflow"]

[data]
train_files = "train.parquet"
val_files = ["a.jsonl", "b.jsonl"]
prompt_key = "messages"
chat_template = true
long_prompts = "drop"

[validation]
every = 5
n = 8
temperature = 0.6

[[rewards]]
function = "my_rewards.py:correct"
weight = 2.0

[[rewards]]
function = "rlkit.data.verifiable:math_reward"
name = "math"
"""


def test_toml_tables_become_the_dataclasses_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    config = config_from_toml(path)
    assert config.data == DataConfig(train_files=["train.parquet"], val_files=["a.jsonl", "b.jsonl"],
                                     prompt_key="messages", chat_template=True, long_prompts="drop")
    assert (config.validation.every, config.validation.n, config.validation.temperature) == (5, 8, 0.6)
    assert config.rewards == [RewardSpec(function="my_rewards.py:correct", weight=2.0),
                              RewardSpec(function="rlkit.data.verifiable:math_reward", name="math")]
    assert config.trackers == ["tensorboard", "mlflow"]
    assert config_from_dict(config.to_dict()) == config


def test_every_form_problem_at_once():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(
            data=DataConfig(train_files=[""], prompt_key="", long_prompts="truncate"),
            validation={"every": -1, "n": 0, "temperature": 0},
            rewards=[RewardSpec(function="no_colon"), RewardSpec(function="m:f", weight=float("nan")),
                     RewardSpec(function="a.py:f", name="x"), RewardSpec(function="b.py:f", name="x")],
            trackers=["tensorboard", "comet", "tensorboard"],
        )
    assert err.value.problems == [
        "data.train_files=['']: give a path or a list of paths (each a non-empty string)",
        'data.prompt_key="": name the column that holds the prompts',
        'data.long_prompts="truncate": use "error" (stop before launch) or "drop"',
        "validation.every=-1: must be >= 0 (0 = only trainer.evaluate())",
        "validation.n=0: must be >= 1 (samples per validation prompt)",
        "validation.temperature=0: must be > 0",
        'rewards[0].function="no_colon": write "my_rewards.py:correct" or "package.module:correct"',
        "rewards[1].weight=nan: must be a finite number",
        "rewards: the name(s) ['x'] are used twice; give each term its own name",
        "trackers=['tensorboard', 'comet', 'tensorboard']: unknown ['comet']; use any of "
        "['tensorboard', 'wandb', 'mlflow']",
        "trackers=['tensorboard', 'comet', 'tensorboard']: a tracker is named twice",
    ]


def test_unknown_reward_setting_names_the_table():
    with pytest.raises(ConfigError, match=r"unknown setting rewards\[0\].wieght: did you mean rewards\[0\].weight\?"):
        config_from_dict({"rewards": [{"function": "a.py:f", "wieght": 2}]})


@pytest.fixture
def fake_companions(tmp_path, monkeypatch):
    """A torchvision that fails to load the way a CUDA build does beside a CPU torch, and a torchaudio that loads."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    (tmp_path / "torchaudio").mkdir()
    (tmp_path / "torchaudio" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torchvision", "torchaudio"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)


def test_broken_torchvision_beside_cpu_torch_is_named_with_the_fix(fake_companions):
    (problem,) = torch_companion_problems()
    assert problem.startswith(f"torchvision is installed but does not load beside torch {torch.__version__} "
                              "(RuntimeError: operator torchvision::nms does not exist)")
    assert problem.endswith(COMPANION_FIX)
    with pytest.raises(ConfigError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        GRPOConfig().check_cluster(1)


def test_a_cuda_torch_is_left_alone(fake_companions, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert torch_companion_problems() == []
