"""A prompt source from the ``[data]`` settings: read, render, measure, filter, all before launch.

:func:`load_prompt_source` is the one call: files (or Python prompts) -> rows -> prompt texts
(chat template where asked) -> token counts against ``max_prompt_tokens`` -> a
:class:`~rlkit.data.prompts.PromptSource` and a :class:`PromptReport` of what was kept and dropped.
The tokenizer is an argument: this layer never loads a model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.data.files import PromptInput, read_files, rows_from_python
from rlkit.data.prompts import PromptSource
from rlkit.data.templates import as_messages, render_prompts

if TYPE_CHECKING:
    from rlkit.config.data import DataConfig

logger = logging.getLogger(__name__)

PROMPT_MESSAGES = "prompt_messages"
"""The item key of a multi-turn run's prompt as chat messages (the workers' trajectories start from them)."""
RESERVED_COLUMNS = ("prompt", "prompts", "completions", PROMPT_MESSAGES)
"""Field names a data column may not take: the rendered prompt, the reward functions' positional arguments, and
a multi-turn run's prompt messages (such a run also reserves rlkit.data.agents.AGENT_FIELDS)."""
EXAMPLES = 3
"""Too-long prompts shown in a problem or a report."""


@dataclass
class PromptReport:
    """What loading one split did: rows read, kept and dropped, and why."""

    split: str
    """ "train" or "val"."""
    source: str
    """The files read, or "prompts given in Python"."""
    rows: int
    """Rows read."""
    kept: int
    """Prompts the source serves."""
    longest: int
    """Tokens in the longest prompt kept."""
    templated: bool
    """Whether the chat template rendered the prompts."""
    fields: list[str] = field(default_factory=list)
    """Columns that reach the reward functions as keyword fields."""
    dropped: int = 0
    """Prompts over max_prompt_tokens left out (data.long_prompts = "drop")."""
    examples: list[str] = field(default_factory=list)
    """The first few prompts dropped, with their token counts."""

    def summary(self) -> str:
        """One line for a person (the CLI prints it before launch)."""
        line = (
            f"{self.split} prompts: {self.kept} of {self.rows} from {self.source} "
            f"(longest {self.longest} tokens{', chat template' if self.templated else ''}; "
            f"fields {self.fields})"
        )
        if self.dropped:
            line += f"; dropped {self.dropped} over max_prompt_tokens, e.g. " + "; ".join(self.examples)
        return line


def load_prompt_source(
    data: DataConfig,
    tokenizer: Any,
    seed: int,
    *,
    max_prompt_tokens: int,
    base_dir: str | Path | None = None,
    split: str = "train",
    prompts: PromptInput | None = None,
) -> tuple[PromptSource, PromptReport]:
    """The prompts of ``split`` ("train": ``data.train_files``, "val": ``data.val_files``), or of ``prompts``.

    ``prompts`` (a ``datasets.Dataset``, a list of dicts or of strings) replaces the split's files.
    Relative file paths are looked up in ``base_dir`` (the TOML file's folder), then the working directory.

    Raises:
        ConfigError: every problem found (missing files or column, bad rows, no chat template,
            prompts too long with ``long_prompts="error"``), each naming the setting and the fix.
    """
    source, report, problems = collect_prompts(
        data, tokenizer, seed, max_prompt_tokens=max_prompt_tokens, base_dir=base_dir, split=split, prompts=prompts
    )
    if problems:
        from rlkit.config import ConfigError  # lazily: config sits beside data, not below it

        raise ConfigError(problems)
    assert source is not None and report is not None
    return source, report


def collect_prompts(
    data: DataConfig,
    tokenizer: Any,
    seed: int,
    *,
    max_prompt_tokens: int,
    base_dir: str | Path | None = None,
    split: str = "train",
    prompts: PromptInput | None = None,
    tools: list[Any] | None = None,
    generation_prompt: bool = True,
) -> tuple[PromptSource | None, PromptReport | None, list[str]]:
    """:func:`load_prompt_source` returning its problems instead of raising them.

    ``tools`` (a multi-turn run's tools' schemas; [] for an environment without tools) renders every prompt
    through the chat template with them, and keeps each prompt's messages in its item (``PROMPT_MESSAGES``);
    ``generation_prompt``: False leaves the template's generation prompt out (a run with an environment).

    The source is None when there are problems; the report is there whenever rows were read (its
    ``fields`` let the reward functions be checked even then). Rows of the files that could be read
    are checked too, so one pass reports a missing file and too-long prompts in another together.
    """
    rows, columns, where, problems = _read_rows(data, split, base_dir, prompts)
    if not rows or data.prompt_key not in columns:
        return None, None, problems + (_column_problems(columns, data.prompt_key, where) if rows else [])
    problems += _column_problems(columns, data.prompt_key, where)
    fields = [c for c in columns if c != data.prompt_key]
    report = PromptReport(split=split, source=where, rows=len(rows), kept=0, longest=0, templated=False, fields=fields)
    values = [r[data.prompt_key] for r in rows]
    chat_template = data.chat_template if tools is None else True
    texts, report.templated, render_problems = render_prompts(values, tokenizer, chat_template, data.prompt_key, tools,
                                                              generation_prompt)  # fmt: skip
    if render_problems:
        return None, report, problems + render_problems
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=not report.templated)["input_ids"]]
    keep, length_problems = _length_filter(lengths, texts, max_prompt_tokens, data.long_prompts, f"data.{split}_files")
    if problems or length_problems:
        return None, report, problems + length_problems
    report.kept, report.longest, report.dropped = len(keep), max(lengths[i] for i in keep), len(rows) - len(keep)
    report.examples = _examples([i for i, n in enumerate(lengths) if n > max_prompt_tokens], lengths, texts)
    logger.log(logging.WARNING if report.dropped else logging.INFO, "%s", report.summary())
    items = [{"prompt": texts[i], **{f: rows[i][f] for f in fields}} for i in keep]
    if tools is not None:
        for item, i in zip(items, keep, strict=True):
            item[PROMPT_MESSAGES] = as_messages(values[i])
    return PromptSource(items, seed=seed, add_special_tokens=not report.templated), report, []


def _read_rows(
    data: DataConfig, split: str, base_dir: str | Path | None, prompts: PromptInput | None
) -> tuple[list[dict[str, Any]], list[str], str, list[str]]:
    """(rows, columns, where they came from, problems) of the split's files or of ``prompts``."""
    if prompts is not None:
        rows, columns, problems = rows_from_python(prompts, data.prompt_key)
        return rows, columns, "prompts given in Python", problems
    setting = f"data.{split}_files"
    paths = data.train_files if split == "train" else data.val_files
    if not paths:
        return [], [], "", [f"{setting} is empty: name the prompt files (or pass the prompts in Python)"]
    rows, columns, problems = read_files(paths, Path(base_dir) if base_dir is not None else None, setting)
    if not rows and not problems:
        problems = [f"{setting}: the files hold no rows; give files with at least one prompt"]
    return rows, columns, ", ".join(paths), problems


def _column_problems(columns: list[str], prompt_key: str, where: str) -> list[str]:
    """The prompt column must be there; no other column may take a reserved name."""
    if prompt_key not in columns:
        return [
            f'data.prompt_key="{prompt_key}" is not a column of {where} (its columns: {columns}); '
            "set prompt_key to the column that holds the prompts"
        ]
    clashes = [c for c in columns if c in RESERVED_COLUMNS and c != prompt_key]
    if clashes:
        return [
            f"{where} has the column(s) {clashes}, names rlkit gives the prompt text and the reward functions' "
            "positional arguments; rename them"
        ]
    return []


def _length_filter(
    lengths: list[int], texts: list[str], limit: int, policy: str, setting: str
) -> tuple[list[int], list[str]]:
    """Indices of the prompts kept, or the problem: too long with policy "error", or nothing left."""
    long = [i for i, n in enumerate(lengths) if n > limit]
    keep = [i for i, n in enumerate(lengths) if n <= limit]
    if long and policy == "error":
        shown = "; ".join(_examples(long, lengths, texts))
        return [], [
            f"{setting}: {len(long)} of {len(lengths)} prompts are longer than data.max_prompt_tokens={limit} "
            f"(the longest has {max(lengths)} tokens; e.g. {shown}); raise data.max_prompt_tokens to "
            f'{max(lengths)}, or set data.long_prompts = "drop" to leave them out'
        ]
    if not keep:
        return [], [
            f"{setting}: every prompt is longer than data.max_prompt_tokens={limit} (the shortest has "
            f"{min(lengths)} tokens); raise data.max_prompt_tokens"
        ]
    return keep, []


def _examples(indices: list[int], lengths: list[int], texts: list[str]) -> list[str]:
    return [f"row {i} ({lengths[i]} tokens): {texts[i][:60]!r}" for i in indices[:EXAMPLES]]
