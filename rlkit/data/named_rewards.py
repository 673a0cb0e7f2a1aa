"""Reward functions named in the config (``[[rewards]] function = "my_rewards.py:correct"``), checked before launch.

A name is ``path/to/file.py:function`` (the file is looked up next to the TOML file, then in the
working directory) or ``package.module:function``. Each function must be callable as
``fn(prompts, completions, **fields)``: its signature is read (``inspect.signature``) against the
data's columns, so a wrong signature or a column the data lacks is found before anything runs.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import cloudpickle

from rlkit.data.files import resolve_path
from rlkit.data.rewards import WeightedReward

if TYPE_CHECKING:
    from rlkit.config.data import RewardSpec

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def load_rewards(
    specs: Sequence[RewardSpec], base_dir: str | Path | None, columns: Collection[str] | None
) -> list[WeightedReward]:
    """The weighted reward terms of ``specs`` (``config.rewards``), each checked against the data's ``columns``
    (the fields every call passes; None when they are not known, which skips the column checks).

    Raises:
        ConfigError: every problem at once: files or modules not found or failing to import, names
            missing, objects not callable, signatures that do not fit, columns the data lacks.
    """
    terms, problems = collect_rewards(specs, base_dir, columns)
    if problems:
        from rlkit.config import ConfigError  # lazily: config sits beside data, not below it

        raise ConfigError(problems)
    return terms


def collect_rewards(
    specs: Sequence[RewardSpec], base_dir: str | Path | None, columns: Collection[str] | None
) -> tuple[list[WeightedReward], list[str]]:
    """:func:`load_rewards` returning its problems instead of raising them."""
    base = Path(base_dir) if base_dir is not None else None
    modules: dict[Path, ModuleType] = {}
    terms, problems = [], []
    for i, spec in enumerate(specs):
        setting = f'rewards[{i}].function="{spec.function}"'
        fn, problem = resolve_object(spec.function, base, modules)
        if problem:
            problems.append(f"{setting}: {problem}")
            continue
        problems += [f"{setting}: {p}" for p in signature_problems(fn, columns)]
        terms.append(WeightedReward(spec.name or getattr(fn, "__name__", f"reward{i}"), fn, float(spec.weight)))
    names = [t.name for t in terms]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        problems.append(f'rewards: several terms are named {clashes}; give each [[rewards]] entry its own name = "..."')
    return terms, problems


def signature_problems(fn: Any, columns: Collection[str] | None) -> list[str]:
    """Why ``fn(prompts, completions, **{c: ... for c in columns})`` would fail, from its signature alone.

    Checks that it takes two positional arguments, that every column can be passed to it by
    keyword (a parameter of that name, or ``**fields``), and that every parameter without a
    default beyond the first two is a column (these two only when ``columns`` is known).
    A callable without a readable signature passes.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = [p for p in params if p.kind in _POSITIONAL]
    if len(positional) < 2 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return [
            f"{_describe(fn)} takes {_shown(params)} but is called as fn(prompts, completions, **fields): "
            "give it two positional parameters first"
        ]
    if columns is None:
        return []
    rest = positional[2:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    problems = []
    by_position = [p.name for p in rest if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
    if by_position:
        problems.append(f"{_describe(fn)} has positional-only parameter(s) {by_position}: fields come by keyword")
    missing = [p.name for p in rest if p.default is p.empty and p.name not in columns and p.name not in by_position]
    if missing:
        problems.append(
            f"{_describe(fn)} needs the column(s) {missing}, which the data does not have (its fields: "
            f"{sorted(columns)}); add them to the data, or give the parameter(s) defaults"
        )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        unaccepted = [c for c in columns if c not in {p.name for p in rest}]
        if unaccepted:
            problems.append(
                f"{_describe(fn)} does not accept the field(s) {unaccepted} that every call passes: "
                "add **fields to its parameters"
            )
    return problems


def resolve_object(function: str, base_dir: Path | None, modules: dict[Path, ModuleType]) -> tuple[Any, str]:
    """The callable ``function`` (``"file.py:name"`` or ``"package.module:name"``) names, or (None, the problem);
    ``modules`` caches the files imported so far (each runs once per check)."""
    where, _, attr = function.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        found, places = resolve_path(where, base_dir)
        if found is None:
            return None, f"no file {where} (looked for {' and '.join(str(p) for p in places)}); fix the path"
        module, problem = _import_file(found.resolve(), modules)
    else:
        module, problem = _import_module(where)
    if module is None:
        return None, problem
    if not hasattr(module, attr):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        return None, f"{where} has no {attr!r} (its callables: {names})"
    fn = getattr(module, attr)
    if not callable(fn):
        return None, f"{where}:{attr} is a {type(fn).__name__}, not a function"
    return fn, ""


def _import_module(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - an import failure of any kind is reported by name
        return None, f"cannot import {name!r} ({type(exc).__name__}: {exc}); install it or put it on PYTHONPATH"


def _import_file(path: Path, modules: dict[Path, ModuleType]) -> tuple[ModuleType | None, str]:
    """Run the file as a fresh module (so edits are picked up) whose functions pickle by value.

    Its functions travel to worker processes by value, as a notebook's do: the workers need not find the file.
    While it runs, its folder is on the path (as Python runs a script), and the modules it imports from there
    travel by value too.
    """
    if path in modules:
        return modules[path], ""
    name = f"rlkit_rewards_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None, f"{path} cannot be imported as Python"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    before = set(sys.modules)
    sys.path.insert(0, str(path.parent))  # as Python runs a script: the modules beside it can be imported
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the file's own error is what the user must see
        del sys.modules[name]
        hint = "; put the folder of that module on PYTHONPATH (or the module beside the file)"
        return None, f"{path} failed to import: {type(exc).__name__}: {exc}" + hint * isinstance(exc, ImportError)
    finally:
        sys.path.remove(str(path.parent))
    for imported in [module, *_beside(set(sys.modules) - before, path.parent)]:
        cloudpickle.register_pickle_by_value(imported)  # the workers need not find the folder
    modules[path] = module
    return module, ""


def _beside(names: set[str], folder: Path) -> list[ModuleType]:
    """The modules of ``names`` whose files lie in ``folder`` (or below it)."""
    files = [(sys.modules[n], getattr(sys.modules[n], "__file__", None)) for n in sorted(names) if n in sys.modules]
    return [m for m, file in files if file and Path(file).resolve().is_relative_to(folder)]


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _shown(params: list[inspect.Parameter]) -> str:
    return "(" + ", ".join(str(p) for p in params) + ")"
