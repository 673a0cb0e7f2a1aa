"""Preference examples (DPO pairs, KTO labelled completions) from files or Python, checked and tokenized before launch.

DPO rows have the columns prompt / chosen / rejected, KTO rows prompt / completion / label (a bool). A prompt
is a string, or a list of ``{"role", "content"}`` messages rendered by the tokenizer's chat template with the
generation prompt. A completion is a string, or a list holding one ``{"role": "assistant", "content": ...}``
message whose content is the completion (TRL's conversational format). Each completion is tokenized without
special tokens and ends with the tokenizer's end-of-text token, as a sampled completion would.

:func:`load_preferences` reads the rows through the RL trainer's loaders (rlkit.data.files), then reports every
problem at once in one ConfigError (missing columns, empty or malformed values, prompts and completions over
``data.max_prompt_tokens`` / ``data.max_completion_tokens``), each naming the rows and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.data.files import PromptInput, read_files, rows_from_python
from rlkit.data.prompts import PromptSource
from rlkit.data.templates import is_message, prompt_kind

if TYPE_CHECKING:
    from rlkit.config.preference import PreferenceConfig

logger = logging.getLogger(__name__)

COLUMNS = {"dpo": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion", "label")}
"""The columns of each algorithm's examples."""
SHIPPED_DIR = Path(__file__).resolve().parent / "examples" / "addition"
"""The bundled addition task's shipped sets, ``dpo.parquet`` and ``kto.parquet`` (scripts/build_preferences.py)."""
EXAMPLES = 3
"""Rows shown in a problem."""


def load_preferences(
    config: PreferenceConfig,
    tokenizer: Any,
    *,
    pairs: PromptInput | None = None,
    base_dir: str | Path | None = None,
    split: str = "train",
) -> tuple[PromptSource, str]:
    """The checked, tokenized examples of ``config.data.train_files``, of ``pairs`` (a ``datasets.Dataset`` or a
    list of dicts; it replaces the files), or with model="tiny" and neither, of the shipped addition set; and a
    summary. ``split="val"``: the held-out examples of ``config.data.val_files`` (or ``pairs``) instead.

    Each item of the returned source (shuffled per epoch by ``config.seed``) holds ``prompt`` (the text),
    ``prompt_ids``, ``completions`` (texts: [chosen, rejected] for DPO, [completion] for KTO),
    ``completion_ids`` (each ending with the end-of-text token) and, for KTO, ``label``.

    Raises:
        ConfigError: every problem of the data at once (the lengths of the rows whose values are fine are
            checked beside the rows that are not), each naming the column or setting and the fix.
    """
    from rlkit.config import ConfigError  # lazily: config sits beside data, not below it

    rows, columns, where, problems = _read(config, pairs, base_dir, split)
    if not rows:
        raise ConfigError(problems)
    value_problems, fine = _value_problems(rows, columns, config.algorithm, tokenizer, where)
    items, encode_problems = _encode([r for r, ok in zip(rows, fine, strict=True) if ok], config, tokenizer, where)
    rows_of = [i for i, ok in enumerate(fine) if ok]  # the row of each item, for the problems
    problems += value_problems + encode_problems + _length_problems(items, rows_of, config, where)
    if problems:
        raise ConfigError(problems)
    prompt_lengths = [len(item["prompt_ids"]) for item in items]
    completion_lengths = [len(ids) for item in items for ids in item["completion_ids"]]
    labels = [item["label"] for item in items if "label" in item]
    summary = (
        f"{config.algorithm} {'held-out ' if split == 'val' else ''}examples: {len(items)} from {where} "
        f"(longest prompt {max(prompt_lengths)} tokens, longest completion {max(completion_lengths)} tokens with the "
        "end-of-text token"
        + (f"; {sum(labels)} desirable, {len(labels) - sum(labels)} undesirable" if labels else "")
        + ")"
    )
    return PromptSource(items, seed=config.seed), summary


def _read(
    config: PreferenceConfig, pairs: PromptInput | None, base_dir: str | Path | None, split: str
) -> tuple[list[dict[str, Any]], list[str], str, list[str]]:
    """(rows, columns, where they came from, problems) of ``pairs``, the split's files, or the shipped set."""
    wanted = ", ".join(COLUMNS[config.algorithm])
    if pairs is not None:
        name = "pairs" if split == "train" else "val_pairs"
        listed = isinstance(pairs, Sequence) and not isinstance(pairs, str | bytes)
        if not (hasattr(pairs, "column_names") or (listed and pairs and all(isinstance(r, dict) for r in pairs))):
            return [], [], name, [
                f"{name}: got {type(pairs).__name__}{' holding non-dicts or nothing' if listed else ''}; give a "
                f"datasets.Dataset or a non-empty list of dicts with the columns {wanted} (files: data.{split}_files)"
            ]
        rows, columns, problems = rows_from_python(pairs, "prompt")  # a list's rows must have the same keys
        return rows, columns, name, [p.replace("prompts", name) for p in problems]
    files = config.data.train_files if split == "train" else config.data.val_files
    setting = f"data.{split}_files"
    if files:
        rows, columns, problems = read_files(files, Path(base_dir) if base_dir else None, setting)
        if not rows and not problems:
            problems = [f"{setting}: the files hold no rows; give files with at least one example"]
        return rows, columns, f"{setting} ({', '.join(files)})", problems
    if split == "val":
        return [], [], "", [f"{setting} is empty: name the held-out example files (or pass val_pairs in Python)"]
    if config.model == "tiny":
        shipped = str(SHIPPED_DIR / f"{config.algorithm}.parquet")
        rows, columns, problems = read_files([shipped], None, "the shipped set")
        return rows, columns, f"the shipped set ({shipped})", problems
    return [], [], "", [
        f"no examples: set data.train_files or pass PreferenceTrainer(pairs=...) (a datasets.Dataset or a list of "
        f'dicts with the columns {wanted}); only model="tiny" has a shipped set'
    ]


def _value_problems(
    rows: list[dict[str, Any]], columns: list[str], algorithm: str, tokenizer: Any, where: str
) -> tuple[list[str], list[bool]]:
    """The problems of every column at once (missing columns, malformed values, no chat template for chat
    prompts), and which rows are fine."""
    wanted = COLUMNS[algorithm]
    missing = [c for c in wanted if c not in columns]
    problems = [
        f"{where} lacks the column(s) {missing} (its columns: {columns}); {algorithm.upper()} examples need "
        f"{list(wanted)}"
    ] if missing else []  # fmt: skip
    fine = [True] * len(rows)
    for column in [c for c in wanted if c in columns]:
        ok, kind = CHECKS[column]
        bad = [not ok(r[column]) for r in rows]
        problems += _bad_rows(where, column, bad, kind, rows)
        fine = [f and not b for f, b in zip(fine, bad, strict=True)]
    chat = ["prompt" in columns and isinstance(r["prompt"], list) for r in rows]
    if any(chat) and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        problems.append(
            f'{where}: column "prompt" holds chat messages but the tokenizer of {name} has no chat template: add '
            '"chat_template" to its tokenizer_config.json (or a chat_template.jinja file beside it), or give '
            "plain-text prompts"
        )
        fine = [f and not c for f, c in zip(fine, chat, strict=True)]
    return problems, fine if not missing else [False] * len(rows)


def _encode(
    rows: list[dict[str, Any]], config: PreferenceConfig, tokenizer: Any, where: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """The items of rows whose values are fine: texts (chat prompts through the template) and token ids."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    completion_columns = COLUMNS[config.algorithm][1 : 1 + config.sequences_per_example]
    items = []
    for row in rows:
        prompt, chat = row["prompt"], isinstance(row["prompt"], list)
        try:
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) if chat else prompt
        except Exception as exc:  # noqa: BLE001 - a template that fails on the data is reported, not raised
            return [], [f"{where}: the tokenizer's chat template failed on the prompts: {type(exc).__name__}: {exc}"]
        completions = [_completion_text(row[c]) for c in completion_columns]
        item = {
            "prompt": text,
            "prompt_ids": tokenizer(text, add_special_tokens=not chat)["input_ids"],
            "completions": completions,
            "completion_ids": [tokenizer(c, add_special_tokens=False)["input_ids"] + eos for c in completions],
        }
        items.append(item | ({"label": row["label"]} if config.algorithm == "kto" else {}))
    return items, []


def _prompt_ok(value: Any) -> bool:
    """A non-empty string or a non-empty list of chat messages."""
    return prompt_kind(value) is not None


def _completion_ok(value: Any) -> bool:
    """A non-empty string or a list holding one assistant message with non-empty content."""
    if isinstance(value, list) and len(value) == 1 and is_message(value[0]) and value[0]["role"] == "assistant":
        value = value[0]["content"]
    return isinstance(value, str) and bool(value.strip())


def _completion_text(value: str | list[dict[str, str]]) -> str:
    """A completion's text: the string, or the content of its one assistant message."""
    return value if isinstance(value, str) else value[0]["content"]


COMPLETION = (_completion_ok, 'a non-empty string or a list of one {"role": "assistant", "content": str} message')
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prompt": (_prompt_ok, 'a non-empty string or a list of {"role": str, "content": str} messages'),
    "chosen": COMPLETION,
    "rejected": COMPLETION,
    "completion": COMPLETION,
    "label": (lambda value: isinstance(value, bool), "a bool (true / false)"),
}
"""Each column's check of a value, and what the check wants (for the problem)."""


def _bad_rows(where: str, column: str, bad: list[bool], wanted: str, rows: list[dict[str, Any]]) -> list[str]:
    """One problem naming the first few rows of ``column`` that are not ``wanted``, or none."""
    indices = [i for i, b in enumerate(bad) if b]
    if not indices:
        return []
    shown = ", ".join(f"row {i}: {rows[i][column]!r:.80}" for i in indices[:EXAMPLES])
    return [f'{where}: column "{column}": {len(indices)} row(s) are not {wanted} ({shown}); fix or remove them']


def _length_problems(
    items: list[dict[str, Any]], rows_of: list[int], config: PreferenceConfig, where: str
) -> list[str]:
    """The prompts over max_prompt_tokens and the completions over max_completion_tokens, each with the rows."""
    names = COLUMNS[config.algorithm][1 : 1 + config.sequences_per_example]
    prompts = [(rows_of[i], "", item["prompt"], item["prompt_ids"]) for i, item in enumerate(items)]
    completions = [
        (rows_of[i], f"{name} ", text, ids)
        for i, item in enumerate(items)
        for name, text, ids in zip(names, item["completions"], item["completion_ids"], strict=True)
    ]
    problems = []
    for what, found, limit in (("prompt", prompts, config.data.max_prompt_tokens),
                               ("completion", completions, config.data.max_completion_tokens)):  # fmt: skip
        long = [f for f in found if len(f[3]) > limit]
        if not long:
            continue
        longest = max(len(f[3]) for f in found)
        shown = "; ".join(f"row {row} {name}({len(ids)} tokens): {text[:60]!r}" for row, name, text, ids in long[:3])
        eos = ", with the end-of-text token" if what == "completion" else ""
        problems.append(
            f"{where}: {len(long)} of {len(found)} {what}s are longer than data.max_{what}_tokens={limit} (the longest "
            f"has {longest} tokens{eos}; e.g. {shown}); raise data.max_{what}_tokens to {longest}, or shorten or "
            "remove them"
        )
    return problems
