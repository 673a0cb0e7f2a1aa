"""Reading a config from plain data (a checkpoint's ``trainer.json``) or a TOML file, by its ``algorithm``."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.config.algorithms import GRPOConfig, PPOConfig
from rlkit.config.checks import ConfigError
from rlkit.config.preference import DPOConfig, KTOConfig, PreferenceConfig
from rlkit.config.run import RLConfig

CONFIGS: dict[str, type[RLConfig] | type[PreferenceConfig]] = {
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
}
"""The config class of each ``algorithm`` name."""


def config_from_dict(data: dict[str, Any]) -> Any:
    """The config that ``data`` (``to_dict()`` output, or TOML tables) describes; ``algorithm`` picks its
    class (default "grpo")."""
    algorithm = data.get("algorithm", "grpo")
    if algorithm not in CONFIGS:
        raise ConfigError([f'algorithm="{algorithm}": use one of {list(CONFIGS)}'])
    return CONFIGS[algorithm].from_dict(data)


def config_from_toml(path: str | Path) -> Any:
    """Read a TOML config (``algorithm = "ppo"`` at the top selects PPOConfig; default "grpo").

    Relative file paths in ``[data]``, ``[[rewards]]``, ``[[tools]]``, ``environment`` and a preference config's
    ``train_files`` are taken from the TOML file's folder when something is there, else left to the working
    directory, so a run's files can sit beside its config.
    """
    path = Path(path)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return config_from_dict(_beside(data, path.parent))


def _beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with relative data-file and reward-file paths made absolute where they exist under ``folder``."""
    def resolve(name: str) -> str:
        candidate = folder / name
        return str(candidate.resolve()) if not Path(name).is_absolute() and candidate.exists() else name

    def resolve_files(table: dict[str, Any], key: str) -> None:
        value = table.get(key)
        if isinstance(value, str):
            table[key] = resolve(value)
        elif isinstance(value, list):
            table[key] = [resolve(v) if isinstance(v, str) else v for v in value]

    data = dict(data)
    resolve_files(data, "train_files")  # DPO and KTO name their examples at the top level
    if isinstance(data.get("data"), dict):
        table = dict(data["data"])
        for key in ("train_files", "val_files"):
            resolve_files(table, key)
        data["data"] = table
    for key in ("rewards", "tools"):
        if isinstance(data.get(key), list):
            data[key] = [_function_beside(spec, resolve) for spec in data[key]]
    if isinstance(data.get("environment"), str):
        data["environment"] = _name_beside(data["environment"], resolve)
    return data


def _function_beside(spec: Any, resolve: Callable[[str], str]) -> Any:
    """A ``[[rewards]]`` or ``[[tools]]`` table whose ``function = "file.py:name"`` points into the TOML's folder."""
    if not isinstance(spec, dict) or not isinstance(spec.get("function"), str):
        return spec
    return {**spec, "function": _name_beside(spec["function"], resolve)}


def _name_beside(named: str, resolve: Callable[[str], str]) -> str:
    """``"file.py:name"`` with the file resolved (module names as they are)."""
    where, sep, name = named.rpartition(":")
    return f"{resolve(where)}{sep}{name}" if where.endswith(".py") else named
