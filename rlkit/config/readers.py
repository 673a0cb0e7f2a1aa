"""Reading a config from plain data (a checkpoint's ``trainer.json``) or a TOML file, by its ``algorithm``.

Layouts of earlier versions are still read, each moved setting with a warning naming its new place:
``[rollout] max_prompt_tokens`` and a DPO/KTO config's top-level ``train_files``, ``max_prompt_tokens`` and
``max_completion_tokens`` are now in ``[data]``; ``run_dir`` (a parent folder) became ``output_dir`` (the
run's own folder).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.config.algorithms import GRPOConfig, PPOConfig
from rlkit.config.checks import ConfigError
from rlkit.config.outputs import default_output_dir
from rlkit.config.preference import DPOConfig, KTOConfig, PreferenceConfig
from rlkit.config.run import RLConfig

logger = logging.getLogger(__name__)

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
    return CONFIGS[algorithm].from_dict(_moved(data, algorithm))


MOVED = {
    "rl": {"rollout.max_prompt_tokens": "data.max_prompt_tokens"},
    "preference": {
        "train_files": "data.train_files",
        "max_prompt_tokens": "data.max_prompt_tokens",
        "max_completion_tokens": "data.max_completion_tokens",
    },
}
"""Settings of earlier layouts, by kind of config: old dotted name -> new dotted name."""


def _moved(data: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """``data`` with the settings of earlier layouts moved to their new places, each with a warning."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    kind = "preference" if issubclass(CONFIGS[algorithm], PreferenceConfig) else "rl"
    for old, new in MOVED[kind].items():
        old_table, _, old_key = old.rpartition(".")
        source = data.get(old_table, {}) if old_table else data
        if not isinstance(source, dict) or old_key not in source:
            continue
        value = source.pop(old_key)
        new_table, _, new_key = new.rpartition(".")
        target = data.setdefault(new_table, {})
        if isinstance(target, dict) and new_key not in target:
            target[new_key] = value
        logger.warning("%s is deprecated: write it as %s under [%s] (read as such for now)",
                       _toml_name(old), new_key, new_table)  # fmt: skip
    if "run_dir" in data and not data.get("output_dir"):
        run_dir = data.pop("run_dir")
        data["output_dir"] = str(Path(run_dir) / default_output_dir(algorithm, str(data.get("model", "tiny"))).name)
        logger.warning("run_dir is deprecated: output_dir names the run's own folder (here %s)", data["output_dir"])
    return data


def _toml_name(dotted: str) -> str:
    table, _, key = dotted.rpartition(".")
    return f"[{table}] {key}" if table else f"{key} (at the top level)"


def config_from_toml(path: str | Path) -> Any:
    """Read a TOML config (``algorithm = "ppo"`` at the top selects PPOConfig; default "grpo").

    Relative file paths in ``[data]``, ``[[rewards]]``, ``[[tools]]`` and ``environment`` are taken from the TOML
    file's folder when something is there, else left to the working directory, so a run's files can sit beside its
    config. A relative ``output_dir`` is the working directory's, as every output of a run.
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
    resolve_files(data, "train_files")  # the top-level train_files of DPO and KTO configs of earlier versions
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
