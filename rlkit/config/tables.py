"""Dicts (a TOML file's tables) into the config dataclasses, naming any unknown setting."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlkit.config.checks import ConfigError
from rlkit.config.correction import RolloutCorrectionConfig
from rlkit.config.data import DataConfig, ValidationConfig
from rlkit.config.sections import (
    CheckpointConfig,
    CriticConfig,
    FSDPConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
)

NESTED: dict[str, type] = {
    "rollout": RolloutConfig,
    "optim": OptimConfig,
    "fsdp": FSDPConfig,
    "checkpoint": CheckpointConfig,
    "reward_model": RewardModelConfig,
    "critic": CriticConfig,
    "data": DataConfig,
    "validation": ValidationConfig,
    "rollout_correction": RolloutCorrectionConfig,
}
"""The dataclass of each nested table, by field name (dicts given for them are converted)."""


def from_table(kind: type, data: dict[str, Any], where: str) -> Any:
    """``kind(**data)`` with nested tables converted; raises ConfigError naming unknown settings and their table."""
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(data) - known)
    if unknown:
        place = f"[{where}]" if where else "the top level"
        raise ConfigError([f"unknown setting(s) {unknown} in {place}: valid ones are {sorted(known)}"])
    data = dict(data)
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    for name, value in data.items():
        if name in NESTED and isinstance(value, dict):
            data[name] = from_table(NESTED[name], value, f"{where}.{name}" if where else name)
    return kind(**data)


def convert_tables(config: Any) -> None:
    """Replace, in place, every nested dict field of ``config`` by its dataclass (a config's __post_init__)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind = NESTED.get(f.name)
        if kind is not None and isinstance(value, dict):
            setattr(config, f.name, from_table(kind, value, f.name))
