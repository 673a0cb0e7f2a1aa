"""Every setting of a config as plain data: its table, name, type, default and docstring.

A field's doc is the string literal under it in the class body (an attribute docstring), read from the source
with :mod:`ast`, so the settings reference (``docs/reference/settings``) is made from the dataclasses themselves
and cannot drift from them.

Example:
    >>> from rlkit.config import GRPOConfig
    >>> from rlkit.config.fields import settings
    >>> seed = next(s for s in settings(GRPOConfig) if s.name == "seed")
    >>> seed.table, seed.annotation, seed.default
    ('', 'int', '0')
    >>> [s.table for s in settings(GRPOConfig) if s.name == "max_turn_tokens"]
    ['agent']
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Setting:
    """One field of a config section."""

    table: str
    """Its TOML table, dotted ("" for the top level, "rollout", "critic.lora"); ``[[rewards]]`` lists are
    "rewards"."""
    name: str
    annotation: str
    """The annotation as written in the source, e.g. ``"float | None"``."""
    default: str
    """``repr`` of the default; a nested section's is its table, e.g. ``"[rollout]"``."""
    doc: str
    """The field's docstring, dedented; "" when it has none."""
    owner: type
    """The dataclass that declares the field."""


def _docstring(node: ast.stmt | None) -> str:
    """The string literal that ``node`` is, dedented, or ""."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return inspect.cleandoc(node.value.value)
    return ""


@cache
def _declared(cls: type) -> dict[str, tuple[str, str]]:
    """name -> (annotation, doc) for the fields ``cls`` itself declares, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    found: dict[str, tuple[str, str]] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = (ast.unparse(node.annotation), _docstring(after))
    return found


def _declaration(cls: type, name: str) -> tuple[type, str, str]:
    """(the class declaring field ``name`` of ``cls``, its annotation, its doc): the nearest in the MRO."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in _declared(klass):
            return (klass, *_declared(klass)[name])
    raise LookupError(f"{cls.__name__}.{name}: no declaration found in the source")


def _section(hint: object) -> type | None:
    """The dataclass a field holds (itself, or the items of a list of them), else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _default(field: dataclasses.Field, table: str) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        return f"[{table}]" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def settings(cls: type, table: str = "") -> list[Setting]:
    """Every setting of config class ``cls`` and of its nested sections, depth first, in declaration order."""
    hints = typing.get_type_hints(cls)
    found: list[Setting] = []
    for field in dataclasses.fields(cls):
        owner, annotation, doc = _declaration(cls, field.name)
        where = f"{table}.{field.name}" if table else field.name
        found.append(Setting(table, field.name, annotation, _default(field, where), doc, owner))
        nested = _section(hints[field.name])
        if nested is not None:
            found.extend(settings(nested, where))
    return found
