"""The data, validation, reward and tracker settings: ``[data]``, ``[validation]``, ``[[rewards]]``, ``trackers``.

Only the form of each setting is checked here (values, names). Whether the files exist, the
columns are there and the reward functions import is checked by :func:`rlkit.data.load_run_data`,
which knows the folder the TOML file lives in; it reports every problem at once before launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlkit.config.checks import need

LONG_PROMPTS = ("error", "drop")
"""What ``data.long_prompts`` may say about prompts over ``data.max_prompt_tokens``."""
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The experiment trackers ``trackers`` may name (each needs its extra: ``pip install 'rlkit[tensorboard]'``)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from: files read by the ``datasets`` library, one row per prompt.

    A row's ``prompt_key`` column is the prompt (a string, or a list of ``{"role", "content"}``
    messages rendered by the tokenizer's chat template); every other column reaches the reward
    functions as a keyword field of the same name (``answer=[...]``).
    """

    train_files: list[str] = field(default_factory=list)
    """Training prompts: .parquet, .jsonl/.json, .csv files or ``datasets`` save_to_disk folders (a string
    or a list; their rows are concatenated). Relative paths are looked up next to the TOML file, then in
    the working directory. Empty: prompts passed in Python (``Trainer(prompts=...)``), or the bundled
    task with model="tiny"."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompts, in the same formats and with the same columns as ``train_files`` (empty: none)."""
    max_prompt_tokens: int = 64
    """Prompts longer than this (in tokens, after the chat template) are rejected before launch with their count
    and examples, or left out with ``long_prompts = "drop"``; the rollout engine is sized for it plus
    ``rollout.max_new_tokens``."""
    prompt_key: str = "prompt"
    """The column holding the prompt (a string or a list of chat messages)."""
    chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (adding the generation prompt). Unset: only
    message lists are rendered; true: plain strings too (as one user message); false: never (a column of
    message lists is then an error)."""
    long_prompts: str = "error"
    """Prompts over ``max_prompt_tokens``: "error" (reported before launch, nothing runs) or
    "drop" (left out, with their count and examples logged before launch)."""

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]

    def problems(self, prefix: str = "data") -> list[str]:
        p = _files_problems(self, prefix)
        need(p, self.max_prompt_tokens >= 1, f"{prefix}.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        need(p, bool(self.prompt_key), f'{prefix}.prompt_key="": name the column that holds the prompts')
        need(
            p,
            self.long_prompts in LONG_PROMPTS,
            f'{prefix}.long_prompts="{self.long_prompts}": use "error" (stop before launch) or "drop"',
        )
        return p


@dataclass(kw_only=True)
class ValidationConfig:
    """How the validation prompts (``data.val_files``) are scored: ``n`` samples each, no training."""

    every: int = 0
    """Evaluate every this many steps during ``fit`` (0: only when ``trainer.evaluate()`` is called)."""
    before_training: bool = False
    """Also evaluate once before the first step of ``fit`` (verl's ``val_before_train``): a row with step 0 in
    the history, the baseline the later passes compare with. Not again after a resume."""
    n: int = 1
    """Completions sampled per validation prompt; pass@k is reported for k = 1, 2, 4, ... up to n."""
    temperature: float = 1.0
    """Sampling temperature of the validation completions, > 0."""

    def problems(self, prefix: str = "validation") -> list[str]:
        p: list[str] = []
        need(p, self.every >= 0, f"{prefix}.every={self.every}: must be >= 0 (0 = only trainer.evaluate())")
        need(p, self.n >= 1, f"{prefix}.n={self.n}: must be >= 1 (samples per validation prompt)")
        need(p, self.temperature > 0, f"{prefix}.temperature={self.temperature}: must be > 0")
        return p


@dataclass(kw_only=True)
class PreferenceDataConfig:
    """Where DPO/KTO examples come from (``[data]``, the same table and names as an RL run's)."""

    train_files: list[str] = field(default_factory=list)
    """The examples: .parquet, .jsonl/.json, .csv files or ``datasets`` save_to_disk folders (a string or a list;
    their rows are concatenated), with the columns prompt/chosen/rejected (DPO) or prompt/completion/label (KTO).
    Relative paths are looked up next to the TOML file, then in the working directory. Empty: the examples
    passed in Python (``PreferenceTrainer(pairs=...)``), or with model="tiny" the shipped addition set."""
    val_files: list[str] = field(default_factory=list)
    """Held-out examples of the same columns (TRL's ``eval_dataset``), scored without training every
    ``validation.every`` steps: ``val/loss``, ``val/rewards/accuracy``, ``val/rewards/margins`` (empty: none)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this (in tokens) are rejected before launch with an error naming them."""
    max_completion_tokens: int = 256
    """Completions longer than this (in tokens, with the end-of-text token) are rejected the same way."""

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]

    def problems(self, prefix: str = "data") -> list[str]:
        p = _files_problems(self, prefix)
        need(p, self.max_prompt_tokens >= 1, f"{prefix}.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        need(
            p,
            self.max_completion_tokens >= 1,
            f"{prefix}.max_completion_tokens={self.max_completion_tokens}: must be >= 1",
        )
        return p


@dataclass(kw_only=True)
class PreferenceValidationConfig:
    """When a DPO/KTO run scores its held-out examples (``data.val_files``) during ``fit``."""

    every: int = 0
    """Evaluate every this many steps during ``fit`` (0: only when ``trainer.evaluate()`` is called)."""
    before_training: bool = False
    """Also evaluate once before the first step (a row with step 0 in the history); not again after a resume."""

    def problems(self, prefix: str = "validation") -> list[str]:
        p: list[str] = []
        need(p, self.every >= 0, f"{prefix}.every={self.every}: must be >= 0 (0 = only trainer.evaluate())")
        return p


def _files_problems(data: DataConfig | PreferenceDataConfig, prefix: str) -> list[str]:
    """train_files and val_files must each be a list of non-empty path strings."""
    p: list[str] = []
    for name in ("train_files", "val_files"):
        paths = getattr(data, name)
        need(
            p,
            isinstance(paths, list) and all(isinstance(x, str) and x.strip() for x in paths),
            f"{prefix}.{name}={paths!r}: give a path or a list of paths (each a non-empty string)",
        )
    return p


@dataclass(kw_only=True)
class RewardSpec:
    """One ``[[rewards]]`` entry: a reward function named by file or module, and its weight in the total."""

    function: str = ""
    """``"path/to/file.py:name"`` (relative to the TOML file, then the working directory) or
    ``"package.module:name"``; the function is ``fn(prompts, completions, **fields) -> list[float]``."""
    weight: float = 1.0
    """Its weight in the total reward (the weighted sum over all terms)."""
    name: str = ""
    """The term's name in metrics (``reward/<name>/mean``); "" = the function's own name."""

    def problems(self, prefix: str = "rewards") -> list[str]:
        p: list[str] = []
        where, _, attr = self.function.rpartition(":")
        need(
            p,
            bool(where.strip()) and bool(attr.strip()),
            f'{prefix}.function="{self.function}": write "my_rewards.py:correct" or "package.module:correct"',
        )
        need(p, math.isfinite(self.weight), f"{prefix}.weight={self.weight}: must be a finite number")
        return p


def rewards_problems(rewards: list[RewardSpec]) -> list[str]:
    """Problems of every ``[[rewards]]`` entry, each named by its position, and of clashing names."""
    p: list[str] = []
    for i, spec in enumerate(rewards):
        p += spec.problems(f"rewards[{i}]")
    named = [spec.name for spec in rewards if spec.name]
    clashes = sorted({n for n in named if named.count(n) > 1})
    need(p, not clashes, f"rewards: the name(s) {clashes} are used twice; give each term its own name")
    return p


def trackers_problems(trackers: list[str]) -> list[str]:
    """Unknown or repeated tracker names."""
    p: list[str] = []
    unknown = [t for t in trackers if t not in TRACKERS]
    need(p, not unknown, f"trackers={trackers}: unknown {unknown}; use any of {list(TRACKERS)}")
    need(p, len(set(trackers)) == len(trackers), f"trackers={trackers}: a tracker is named twice")
    return p
