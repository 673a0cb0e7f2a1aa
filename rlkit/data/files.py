"""Rows of prompts from files (parquet, jsonl/json, csv, ``datasets`` folders) or from Python objects.

Files are read by the ``datasets`` library, the loader the ecosystem's data comes in; a
``datasets.Dataset``, a list of dicts or a list of strings passed in Python need nothing read.
Every function here reports problems as a list of strings, so a caller can gather them all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it (a folder is a ``save_to_disk`` dataset)."""

Rows = list[dict[str, Any]]
PromptInput = Any
"""What Python code may pass as prompts: a ``datasets.Dataset``, a list of dicts or a list of strings."""


def resolve_path(path: str, base_dir: Path | None) -> tuple[Path | None, list[Path]]:
    """The existing file for ``path``: next to the TOML file (``base_dir``), then in the working directory.

    Returns the path found (or None) and the places looked in.
    """
    given = Path(path).expanduser()
    if given.is_absolute():
        places = [given]
    else:
        places = ([base_dir / given] if base_dir is not None else []) + [Path.cwd() / given]
    found = next((p for p in places if p.exists()), None)
    return found, places


def read_files(paths: Sequence[str], base_dir: Path | None, setting: str) -> tuple[Rows, list[str], list[str]]:
    """Read and concatenate the rows of ``paths`` (``setting`` names them in problems, e.g. "data.train_files").

    Returns (rows, columns, problems); rows are plain dicts, columns those of the first file.
    """
    rows: Rows = []
    columns: list[str] = []
    problems: list[str] = []
    for path in paths:
        found, places = resolve_path(path, base_dir)
        if found is None:
            looked = " and ".join(str(p) for p in places)
            problems.append(f'{setting}: "{path}" does not exist (looked for {looked}); fix the path')
            continue
        table, problem = _read_one(found, f'{setting}: "{path}"')
        if problem:
            problems.append(problem)
            continue
        if not columns:
            columns = list(table.column_names)
        elif list(table.column_names) != columns:
            problems.append(
                f'{setting}: "{path}" has columns {list(table.column_names)} but the first file has {columns}; '
                "every file of a split needs the same columns"
            )
            continue
        rows += table.to_list()
    return rows, columns, problems


def _read_one(path: Path, name: str) -> tuple[Any, str]:
    """A ``datasets.Dataset`` of one file or folder, or (None, the problem)."""
    import datasets

    datasets.disable_progress_bars()
    if path.is_dir():
        return _read_folder(path, name)
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        kind = path.suffix or "suffix-less"
        return None, f"{name} is a {kind} file; use one of {sorted(FORMATS)} or a datasets folder"
    if _is_empty(path, builder):
        return None, f"{name} is empty ({path.stat().st_size} bytes, no rows); give a file with at least one row"
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train"), ""
    except Exception as exc:  # noqa: BLE001 - any read failure is reported with the file's name
        return None, f"{name} could not be read as {builder}: {type(exc).__name__}: {_first_line(exc)}"


def _is_empty(path: Path, builder: str) -> bool:
    """Whether ``path`` holds nothing: no bytes, or (a text format) only whitespace in its first 64 KiB."""
    size = path.stat().st_size
    if size == 0 or builder == "parquet":
        return size == 0
    with open(path, "rb") as f:
        return size <= 64 * 1024 and not f.read().strip()


def _read_folder(path: Path, name: str) -> tuple[Any, str]:
    import datasets

    try:
        table = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - any read failure is reported with the folder's name
        return None, (
            f"{name} is a folder but not a datasets save_to_disk folder ({type(exc).__name__}: {_first_line(exc)}); "
            "give a file or a folder written by Dataset.save_to_disk"
        )
    if isinstance(table, datasets.DatasetDict):
        return None, f"{name} holds the splits {list(table)}: give one split's folder, e.g. {path / next(iter(table))}"
    return table, ""


def rows_from_python(prompts: PromptInput, prompt_key: str) -> tuple[Rows, list[str], list[str]]:
    """Rows of a ``datasets.Dataset``, a list of dicts, or a list of strings (each becomes ``{prompt_key: s}``).

    Returns (rows, columns, problems).
    """
    if hasattr(prompts, "to_list") and hasattr(prompts, "column_names"):
        return prompts.to_list(), list(prompts.column_names), []
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        kind = type(prompts).__name__
        return [], [], [f"prompts: got {kind}; give a datasets.Dataset, a list of dicts or a list of strings"]
    if len(prompts) == 0:
        return [], [], ["prompts is empty: give at least one prompt"]
    rows = [{prompt_key: p} if isinstance(p, str) else p for p in prompts]
    bad = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    if bad:
        return [], [], [f"prompts[{bad[0]}] is a {type(rows[bad[0]]).__name__}: each prompt is a string or a dict"]
    columns = list(rows[0])
    uneven = [i for i, r in enumerate(rows) if list(r) != columns and set(r) != set(columns)]
    if uneven:
        return [], [], [f"prompts[{uneven[0]}] has keys {sorted(rows[uneven[0]])} but prompts[0] has {sorted(columns)}"]
    return rows, columns, []


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
