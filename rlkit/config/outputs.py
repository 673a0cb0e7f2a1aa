"""A run's folder on disk: its default name, and the config written into it as TOML (``config.toml``)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

OUTPUTS = "outputs"
"""The folder, under the working directory, that holds the runs whose ``output_dir`` is not set."""
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def default_output_dir(algorithm: str, model: str, when: float | None = None) -> Path:
    """``outputs/<algorithm>-<model name>-<YYYYmmdd-HHMMSS>`` under the working directory (absolute).

    The model's name is its directory's own name ("tiny" for the bundled model).
    """
    name = Path(model.rstrip("/")).name or "model"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return Path.cwd() / OUTPUTS / f"{algorithm}-{name}-{stamp}"


def to_toml(data: dict[str, Any]) -> str:
    """``data`` (a config's ``to_dict()``: plain values, lists, nested dicts, lists of dicts) as TOML text that
    :func:`rlkit.config.config_from_toml` reads back. TOML has no None: such settings are written as comments."""
    lines = _table(data, [])
    return "\n".join(lines).strip() + "\n"


def _table(data: dict[str, Any], path: list[str]) -> list[str]:
    """The plain keys of one table first, then its sub-tables and arrays of tables (TOML's order)."""
    lines: list[str] = []
    nested: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            nested.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            nested.append((key, value))
        elif value is None:
            lines.append(f"# {_key(key)}: None (TOML has no None; this is the setting's value in Python)")
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in nested:
        name = ".".join(_key(k) for k in [*path, key])
        if isinstance(value, dict):
            lines += ["", f"[{name}]", *_table(value, [*path, key])]
        else:
            for item in value:
                lines += ["", f"[[{name}]]", *_table(item, [*path, key])]
    return lines


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)
