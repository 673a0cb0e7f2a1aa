"""Dicts (a TOML file's tables) into the config dataclasses, naming every unknown setting with its closest valid name.

The valid names come from the dataclasses themselves: a field whose type is a dataclass is a nested table
(``[rollout]``), a ``list[<dataclass>]`` field an array of tables (``[[rewards]]``). A section added to a config
is picked up without a list to keep in step.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from rlkit.config.checks import ConfigError


def nested_kinds(kind: type) -> dict[str, tuple[type, bool]]:
    """The fields of dataclass ``kind`` that are tables: name -> (their dataclass, whether a list of them)."""
    hints = typing.get_type_hints(kind)
    out: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(kind):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out[f.name] = (typing.cast(type, hint), False)
        elif typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint) or (None,)
            if dataclasses.is_dataclass(item):
                out[f.name] = (typing.cast(type, item), True)
    return out


def unknown_settings(kind: type, data: dict[str, Any], where: str = "") -> list[str]:
    """One problem per key of ``data`` (and of its nested tables, all of them) that ``kind`` has no setting for,
    each with the closest valid name: in its own table, else the same name in another table."""
    every = setting_names(kind)
    problems = []
    for path in _unknown_paths(kind, data, where):
        table, _, key = path.rpartition(".")
        table_kind = _kind_at(kind, table)
        here = [f.name for f in dataclasses.fields(table_kind)]
        close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
        elsewhere = [name for name in every if name.rpartition(".")[2] == key and name != path]
        if close:
            hint = f"did you mean {_join(table, close[0])}?"
        elif elsewhere:
            hint = f"did you mean {elsewhere[0]} (under [{_strip_index(elsewhere[0].rpartition('.')[0])}])?"
        else:
            near = difflib.get_close_matches(key, [n.rpartition(".")[2] for n in every], n=1, cutoff=0.75)
            where_near = [n for n in every if near and n.rpartition(".")[2] == near[0]]
            place = f"[{_strip_index(table)}]" if table else "the top level"
            hint = f"did you mean {where_near[0]}?" if where_near else f"{place} has no such setting; remove it"
        problems.append(f"unknown setting {path}: {hint}")
    return problems


def setting_names(kind: type, prefix: str = "") -> list[str]:
    """Every setting of ``kind`` as a dotted name (``rollout.max_new_tokens``), tables' settings included."""
    tables = nested_kinds(kind)
    names = []
    for f in dataclasses.fields(kind):
        name = _join(prefix, f.name)
        if f.name in tables:
            names += setting_names(tables[f.name][0], name)
        else:
            names.append(name)
    return names


def known_only(kind: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys (at any depth) that ``kind`` has no setting for."""
    names = {f.name for f in dataclasses.fields(kind)}
    tables = nested_kinds(kind)
    out = {}
    for key, value in data.items():
        if key not in names:
            continue
        if key in tables and isinstance(value, dict) and not tables[key][1]:
            value = known_only(tables[key][0], value)
        elif key in tables and isinstance(value, list):
            value = [known_only(tables[key][0], v) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out


def from_table(kind: type, data: dict[str, Any], where: str) -> Any:
    """``kind(**data)`` with nested tables converted; raises ConfigError naming every unknown setting."""
    problems = unknown_settings(kind, data, where)
    if problems:
        raise ConfigError(problems)
    data = dict(data)
    if isinstance(data.get("betas"), list):  # TOML has no tuples (another type is named by the config's check)
        data["betas"] = tuple(data["betas"])
    for name, (table, many) in nested_kinds(kind).items():
        value = data.get(name)
        _check_list(name, value, many, where)
        if many and isinstance(value, list):
            data[name] = [from_table(table, v, f"{_join(where, name)}[{i}]") if isinstance(v, dict) else v
                          for i, v in enumerate(value)]  # fmt: skip
        elif isinstance(value, dict):
            data[name] = from_table(table, value, _join(where, name))
    return kind(**data)


def config_from_tables(kind: type, data: dict[str, Any]) -> Any:
    """A run config from plain tables: unknown settings (with suggestions) and the config's own problems are
    reported together, in one ConfigError."""
    unknown = unknown_settings(kind, data)
    try:
        config = from_table(kind, known_only(kind, data), "")
    except ConfigError as exc:
        raise ConfigError(unknown + exc.problems) from None
    if unknown:
        raise ConfigError(unknown)
    return config


def convert_tables(config: Any) -> None:
    """Replace, in place, every nested dict field of ``config`` (at any depth) by its dataclass (a config's
    __post_init__)."""
    for name, (kind, many) in nested_kinds(type(config)).items():
        value = getattr(config, name)
        _check_list(name, value, many, "")
        if many and isinstance(value, list):
            setattr(config, name, [from_table(kind, v, f"{name}[{i}]") if isinstance(v, dict) else v
                                   for i, v in enumerate(value)])  # fmt: skip
        elif isinstance(value, dict):
            setattr(config, name, from_table(kind, value, name))
        elif isinstance(value, kind):
            convert_tables(value)  # a section made in Python may hold dicts: critic=CriticConfig(lora={...})


def _check_list(name: str, value: Any, many: bool, where: str) -> None:
    """Raise ConfigError naming the fix when an array of tables (``[[tools]]``) was given one table or one value."""
    if not many or value is None or isinstance(value, list | tuple):
        return
    label = getattr(value, "__name__", None) or type(value).__name__
    raise ConfigError([
        f"{_join(where, name)} is one {'table' if isinstance(value, dict) else label} where a list is expected: in "
        f"TOML write [[{name}]] (two brackets, one table per entry), in Python {name}=[...]"
    ])  # fmt: skip


def _unknown_paths(kind: type, data: dict[str, Any], where: str) -> list[str]:
    names = {f.name for f in dataclasses.fields(kind)}
    tables = nested_kinds(kind)
    paths = []
    for key, value in data.items():
        path = _join(where, key)
        if key not in names:
            paths.append(path)
        elif key in tables and isinstance(value, dict) and not tables[key][1]:
            paths += _unknown_paths(tables[key][0], value, path)
        elif key in tables and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    paths += _unknown_paths(tables[key][0], item, f"{path}[{i}]")
    return paths


def _kind_at(kind: type, table: str) -> type:
    """The dataclass of the table at dotted ``table`` ("" is ``kind`` itself; list indices are skipped)."""
    for part in filter(None, _strip_index(table).split(".")):
        kind = nested_kinds(kind)[part][0]
    return kind


def _strip_index(path: str) -> str:
    return ".".join(part.split("[")[0] for part in path.split("."))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
