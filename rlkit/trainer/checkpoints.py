"""Checkpoint folders on disk: atomic publication, discovery of the latest complete one, keep-last-K.

A checkpoint is ``<root>/step-<N>/`` holding ``trainer.json`` (config, step,
prompt position, history, its models' shapes: :func:`model_record`), ``actor/``
(distributed checkpoint of the actor and its optimizer), ``actor_rank<r>.pt`` and
``rng_rank<r>.pt`` (schedule and RNG per rank), with PPO ``critic/`` and
``critic_rank<r>.pt``, and ``hf/`` (a Hugging Face export). It is written under a
hidden ``.step-<N>.partial-*`` name and renamed into place only when complete, so a crash mid-save leaves the previous
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

SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts",
                "num_local_experts", "moe_intermediate_size")  # fmt: skip
"""The fields of a model's config.json (or of its ``text_config``) that decide its tensors and their shapes."""


def model_record(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What a checkpoint records of its run's models (``config``: ``to_dict()`` output): per role, the ``model`` setting
    and the SHAPE_FIELDS of that model's config.json as it is now ({} where it cannot be read)."""
    return {role: {"model": model, "shape": _shape(model)} for role, model in _models(config).items()}


def _models(config: dict[str, Any]) -> dict[str, str]:
    """setting -> the model it names: the policy's ``model``, and PPO's ``critic.model`` ("" is the policy's)."""
    models = {"model": str(config.get("model", ""))}
    critic = config.get("critic")
    if isinstance(critic, dict):
        models["critic.model"] = str(critic.get("model") or models["model"])
    return models


def _shape(model: str) -> dict[str, Any]:
    """SHAPE_FIELDS of ``model``'s config.json (``text_config.`` ones too); {} without a readable one."""
    from rlkit.models import resolve_model_dir

    try:
        with open(resolve_model_dir(model) / "config.json") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    text = found.get("text_config") if isinstance(found.get("text_config"), dict) else {}
    shape = {key: found[key] for key in SHAPE_FIELDS if key in found}
    return shape | {f"text_config.{key}": text[key] for key in SHAPE_FIELDS if key in text}


def resume_problems(checkpoint: Path, config: Any) -> list[str]:
    """What stops ``config`` from resuming ``checkpoint`` (read before any worker loads it): a model whose tensors
    have other shapes than the checkpoint's model (its config.json), named with both models, and each setting of
    SHAPE_SETTINGS whose value differs from the checkpoint's run, named with both values."""
    meta = read_meta(checkpoint)
    saved = meta["config"]
    now = config.to_dict()
    problems = _model_problems(checkpoint, meta.get("models") or model_record(saved), model_record(now))
    for setting in SHAPE_SETTINGS:
        before, after = _lookup(saved, setting), _lookup(now, setting)
        if before != after:
            problems.append(
                f"the checkpoint {checkpoint.name} has {setting} {before!r}, the config {after!r}: its tensors "
                f"have other shapes; resume with {setting} = {before!r}, or start a new run"
            )
    return problems


def _model_problems(checkpoint: Path, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One problem per role whose model now has other SHAPE_FIELDS than the checkpoint's (checkpoints written before
    rlkit recorded them: its model's folder as it is now)."""
    problems = []
    for role, before in saved.items():
        after = now.get(role)
        if after is None or not before["shape"] or not after["shape"]:
            continue
        differ = [k for k in before["shape"] if k in after["shape"] and before["shape"][k] != after["shape"][k]]
        if not differ:
            continue
        was = ", ".join(f"{k} {before['shape'][k]}" for k in differ)
        is_ = ", ".join(f"{k} {after['shape'][k]}" for k in differ)
        same = before["model"] == after["model"]
        problems.append(
            f'the checkpoint {checkpoint.name} was trained from {role} = "{before["model"]}" ({was}); the config\'s '
            f'{role} = "{after["model"]}" {"is now" if same else "has"} {is_}: its tensors have other shapes. Resume '
            f'with {role} = "{before["model"]}"' + (" as it was" if same else "") + ", or start a new run (without "
            "--resume, in another output_dir)"
        )
    return problems


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    """A nested dict's value at ``dotted`` ("lora.rank"); None where a part is missing (GRPO has no critic)."""
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
