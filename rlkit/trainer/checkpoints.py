"""Checkpoint folders on disk: atomic publication, discovery of the latest complete one, keep-last-K.

A checkpoint is ``<root>/step-<N>/`` holding ``trainer.json`` (config, step,
prompt position, history), ``actor/`` (distributed checkpoint of the actor and
its optimizer), ``actor_rank<r>.pt`` and ``rng_rank<r>.pt`` (schedule and RNG
per rank), with PPO ``critic/`` and ``critic_rank<r>.pt``, and ``hf/`` (a
Hugging Face export). It is written under a hidden ``.step-<N>.partial-*`` name and
renamed into place only when complete, so a crash mid-save leaves the previous
checkpoints untouched and the partial one is never picked up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^step-(\d+)$")
META = "trainer.json"


def partial_dir(root: Path, step: int) -> Path:
    """A fresh hidden folder to write step ``step`` into."""
    path = root / f".step-{step:06d}.partial-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def publish(partial: Path, step: int, meta: dict[str, Any], keep_last: int) -> Path:
    """Write the metadata last, fsync, rename ``partial`` to ``step-<N>``, then drop all but the last ``keep_last``."""
    meta_path = partial / META
    with open(meta_path, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    final = partial.parent / f"step-{step:06d}"
    replace_folder(partial, final)
    for old in complete(partial.parent)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


@contextmanager
def written_in_place(path: Path) -> Iterator[Path]:
    """``with written_in_place(path) as partial:`` write into ``partial``, a hidden folder beside ``path``; at the end
    of the block it replaces ``path`` (:func:`replace_folder`); a block that raises leaves ``path`` as it was."""
    partial = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    replace_folder(partial, path)


def replace_folder(partial: Path, final: Path) -> None:
    """Put the complete folder ``partial`` in place of ``final`` by renames: ``final`` is never half-written; at every
    moment it is the old folder, absent, or the new one (the old one is renamed aside first, then removed)."""
    aside = None
    if final.exists():
        aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside)


def complete(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest first (partial folders are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else the latest complete checkpoint under it."""
    path = Path(path)
    if (path / META).is_file():
        return path
    found = complete(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {path} (looked for step-*/{META})")
    return found[-1]


def read_meta(checkpoint: Path) -> dict[str, Any]:
    with open(checkpoint / META) as f:
        return json.load(f)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SHAPE_SETTINGS = ("lora.rank", "lora.target_modules", "lora.modules_to_save", "critic.lora.rank",
                  "critic.lora.target_modules", "critic.lora.modules_to_save")  # fmt: skip
"""Settings that change which tensors a checkpoint holds, and their shapes: a resume must keep them."""


def resume_problems(checkpoint: Path, config: Any) -> list[str]:
    """What stops ``config`` from resuming ``checkpoint`` (read before any worker loads it): each setting of
    SHAPE_SETTINGS whose value differs from the checkpoint's run, named with both values."""
    saved = read_meta(checkpoint)["config"]
    now = config.to_dict()
    problems = []
    for setting in SHAPE_SETTINGS:
        before, after = _lookup(saved, setting), _lookup(now, setting)
        if before != after:
            problems.append(
                f"the checkpoint {checkpoint.name} has {setting} {before!r}, the config {after!r}: its tensors "
                f"have other shapes; resume with {setting} = {before!r}, or start a new run"
            )
    return problems


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    """A nested dict's value at ``dotted`` ("lora.rank"); None where a part is missing (GRPO has no critic)."""
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
