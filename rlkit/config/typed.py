"""Settings of the wrong type, found from the config dataclasses' own annotations (one walk, no list per field).

A TOML file or a Python call can put any value in any setting; the value checks (``problems()``) compare numbers and
would fail on a string with a traceback, or let ``rank = 8.5`` through to the workers. :func:`type_problems` walks a
config and its nested sections (``[lora]``, ``[[rewards]]``, ...) and names every setting whose value does not fit
its annotation: the setting, the type expected and the value given. ``bool`` is not an integer; an integer is a
number (a float setting takes ``1``); a fixed-length ``tuple[...]`` takes a list too (TOML has no tuples).

Example:
    >>> from rlkit.config import LoraConfig
    >>> from rlkit.config.typed import type_problems
    >>> for problem in type_problems(LoraConfig(rank="eight", alpha=16, target_modules=["q_proj", 3]), "lora"):
    ...     print(problem)
    lora.rank="eight": must be an integer, not a string
    lora.target_modules=['q_proj', 3]: must be a list of strings or a string, not a list holding an integer (3)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

SHOWN_CHARS = 60
"""A value given is shown up to this many characters (a huge list or string is cut, with "...")."""


def type_problems(config: Any, prefix: str = "") -> list[str]:
    """One message per setting of the dataclass instance ``config`` (its nested sections and lists of sections
    included, named ``prefix.name``) whose value does not fit the field's annotation."""
    hints = typing.get_type_hints(type(config))
    problems: list[str] = []
    for field in dataclasses.fields(config):
        name = f"{prefix}.{field.name}" if prefix else field.name
        problems += _value_problems(name, getattr(config, field.name), hints[field.name])
    return problems


def _value_problems(name: str, value: Any, hint: Any) -> list[str]:
    """The problems of one setting: a nested section is walked; any other value is held against ``hint``."""
    section = _section(hint)
    if section is not None and isinstance(value, section):
        return type_problems(value, name)
    item = _section_items(hint)
    if item is not None and isinstance(value, list) and all(isinstance(v, item) for v in value):
        return [p for i, v in enumerate(value) for p in type_problems(v, f"{name}[{i}]")]
    if section is None and item is None and _fits(value, hint):
        return []
    return [f"{name}={_shown(value)}: must be {_expected(hint, name)}, not {_given(value, hint)}"]


def _section(hint: Any) -> type | None:
    """The dataclass ``hint`` is, else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _section_items(hint: Any) -> type | None:
    """The dataclass of a ``list[<dataclass>]`` hint (an array of tables), else None."""
    args = typing.get_args(hint)
    return _section(args[0]) if typing.get_origin(hint) is list and len(args) == 1 else None


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (an annotation rlkit's configs use); an unknown construct fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if _alternatives(hint) != (hint,):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is tuple:
        return isinstance(value, list | tuple) and _tuple_fits(value, args)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    return isinstance(value, hint) if isinstance(hint, type) else True


def _tuple_fits(value: list | tuple, args: tuple) -> bool:
    """``tuple[X, ...]``: every item an X; ``tuple[X, Y]``: as many items, each of its type."""
    if len(args) == 2 and args[1] is Ellipsis:
        return all(_fits(v, args[0]) for v in value)
    return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))


NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "None"}
PLURALS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def _expected(hint: Any, name: str) -> str:
    """``hint`` in words: "an integer", "a list of strings or a string", "a [lora] table (LoraConfig)"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in NAMES:
        return NAMES[hint]
    if _section(hint) is not None:
        return f"a [{_table(name)}] table ({hint.__name__})"
    if _section_items(hint) is not None:
        return f"a list of [[{_table(name)}]] tables ({args[0].__name__})"
    if origin is typing.Literal:
        return "one of " + ", ".join(_shown(a) for a in args)
    if _alternatives(hint) != (hint,):
        return " or ".join(_expected(a, name) for a in sorted(args, key=lambda a: a is type(None)))
    if origin is list and args:
        return f"a list of {_plural(args[0], name)}"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_plural(args[0], name)}"
    if origin is tuple and args and len(set(args)) == 1:
        return f"a list of {len(args)} {_plural(args[0], name)}"
    if origin is tuple:
        return f"a list of {len(args)} items: " + ", ".join(_expected(a, name) for a in args)
    if origin is dict and args:
        return f"a table of {_plural(args[1], name)}"
    return getattr(hint, "__name__", str(hint))


def _plural(hint: Any, name: str) -> str:
    return PLURALS.get(hint) or f"items each {_expected(hint, name)}"


def _given(value: Any, hint: Any) -> str:
    """What ``value`` is, in words; a list or table of the expected kind names its first item of the wrong type."""
    kind = _kind(value)
    shapes = [a for a in _alternatives(hint) if isinstance(value, _CONTAINERS.get(typing.get_origin(a), ()))]
    if not shapes:
        return kind
    origin, args = typing.get_origin(shapes[0]), typing.get_args(shapes[0])
    if origin is dict:
        pairs = [(v, args[1] if args else Any) for v in value.values()]
    elif origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            return f"{kind} of {len(value)} item{'s' * (len(value) != 1)}"
        pairs = list(zip(value, args, strict=True))
    else:
        pairs = [(v, args[0] if args else Any) for v in value]
    bad = [v for v, h in pairs if not _fits(v, h)]
    return f"{kind} holding {_kind(bad[0])} ({_shown(bad[0])})" if bad else kind


_CONTAINERS: dict[Any, type | tuple[type, ...]] = {list: list, tuple: (list, tuple), dict: dict}
"""The values a ``list[...]``, ``tuple[...]`` or ``dict[...]`` annotation takes."""


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """The members of a union, else ``hint`` alone."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return typing.get_args(hint) if union else (hint,)


def _kind(value: Any) -> str:
    """``value``'s type in words."""
    for kind, words in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                        (list, "a list"), (tuple, "a tuple"), (dict, "a table")):  # fmt: skip
        if isinstance(value, kind):
            return words
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'AEIOUaeiou' else 'a'} {name}"


def _shown(value: Any) -> str:
    """``value`` as the other config messages show it (strings in double quotes), cut to SHOWN_CHARS."""
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _table(name: str) -> str:
    """A setting's dotted name as its TOML table: list positions dropped ("rewards[0].x" -> "rewards.x")."""
    return ".".join(part.split("[")[0] for part in name.split("."))
