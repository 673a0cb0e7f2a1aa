"""Everything a run reads before launch, in one call: training and validation prompts and the reward terms.

:func:`load_run_data` gathers the problems of every part (files, columns, chat template, prompt
lengths, reward files and signatures) and raises them together as one ConfigError, so a person
fixes a config in one pass and nothing expensive starts on a config that cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.config.checks import ConfigError
from rlkit.config.run import RLConfig
from rlkit.data.files import PromptInput
from rlkit.data.loading import PromptReport, collect_prompts
from rlkit.data.named_rewards import collect_rewards, signature_problems
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import WeightedReward, reward_terms
from rlkit.data.tasks import AdditionTask, addition_reward

TASK_FIELDS = ["answer"]
"""The fields of the bundled addition task's rows (model="tiny" without data)."""


@dataclass
class RunData:
    """The prompt sources and reward terms of a run, checked."""

    train: PromptSource
    """Training prompts, shuffled per epoch; its state_dict is the resumable position."""
    val: PromptSource | None
    """Validation prompts in file order (``val.items``), or None without ``data.val_files``."""
    rewards: list[WeightedReward]
    """The reward terms: ``reward_fn`` given in Python, then ``[[rewards]]``; a reward model comes on top."""
    reports: list[PromptReport]
    """What loading each split did (rows kept and dropped); empty for the bundled task."""

    def summary(self) -> str:
        """Lines for a person: each split's report and the reward terms with their weights."""
        terms = ", ".join(f"{t.name} x {t.weight:g}" for t in self.rewards) or "the reward model alone"
        return "\n".join([*(r.summary() for r in self.reports), f"rewards: {terms}"])


def load_run_data(
    config: RLConfig,
    tokenizer: Any,
    *,
    base_dir: str | Path | None = None,
    prompts: PromptInput | None = None,
    val_prompts: PromptInput | None = None,
    reward_fn: Any = None,
) -> RunData:
    """The checked prompts and rewards of ``config`` (``prompts``/``val_prompts``/``reward_fn`` from Python
    replace or join them); relative paths are looked up in ``base_dir`` (the TOML file's folder), then the CWD.

    model="tiny" without data files or prompts trains on the bundled addition task, scored by
    ``addition_reward`` unless rewards are given.

    Raises:
        ConfigError: every problem of the data and the rewards at once, each naming the setting and the fix.
    """
    train, train_report, fields, problems = _train_source(config, tokenizer, base_dir, prompts)
    val, val_report = None, None
    if val_prompts is not None or config.data.val_files:
        val, val_report, val_problems = collect_prompts(
            config.data, tokenizer, config.seed, max_prompt_tokens=config.data.max_prompt_tokens,
            base_dir=base_dir, split="val", prompts=val_prompts,
        )
        problems += val_problems
        if val_report is not None and fields is not None and val_report.fields != fields:
            problems.append(
                f"the validation data has the fields {val_report.fields} but the training data has {fields}: "
                "give both the same columns (the reward functions get them)"
            )
    if fields is None and val_report is not None:
        fields = val_report.fields
    task = prompts is None and not config.data.train_files and config.model == "tiny"
    rewards, reward_problems = _rewards(config, base_dir, fields, reward_fn, task=task)
    problems += reward_problems
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # a problem both splits share is reported once
    assert train is not None
    reports = [r for r in (train_report, val_report) if r is not None]
    return RunData(train=train, val=val, rewards=rewards, reports=reports)


def _train_source(
    config: RLConfig, tokenizer: Any, base_dir: str | Path | None, prompts: PromptInput | None
) -> tuple[PromptSource | None, PromptReport | None, list[str] | None, list[str]]:
    """(source, report, fields, problems); the bundled task has no report; fields are None when unknown."""
    if prompts is None and not config.data.train_files:
        if config.model == "tiny":
            return PromptSource(task=AdditionTask(), seed=config.seed), None, TASK_FIELDS, []
        return None, None, None, [
            'data.train_files is empty: name the prompt files (or pass prompts in Python); only model="tiny" '
            "has a bundled task"
        ]
    source, report, problems = collect_prompts(
        config.data, tokenizer, config.seed, max_prompt_tokens=config.data.max_prompt_tokens,
        base_dir=base_dir, split="train", prompts=prompts,
    )
    return source, report, report.fields if report is not None else None, problems


def _rewards(
    config: RLConfig, base_dir: str | Path | None, fields: list[str] | None, reward_fn: Any, *, task: bool
) -> tuple[list[WeightedReward], list[str]]:
    """The reward terms and their problems; signatures are checked against the fields when they are known."""
    python_terms = reward_terms(reward_fn) if reward_fn is not None else []
    problems = [f"reward_fn {t.name!r}: {p}" for t in python_terms for p in signature_problems(t.fn, fields)]
    named, named_problems = collect_rewards(config.rewards, base_dir, fields)
    terms = python_terms + named
    problems += named_problems
    names = [t.name for t in terms]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes and python_terms and named:
        problems.append(f"reward_fn and [[rewards]] both have a term named {clashes}: rename one")
    if not terms and task and not config.reward_model.path:
        terms = [WeightedReward("addition_reward", addition_reward, 1.0)]
    if not terms and not config.rewards and not config.reward_model.path:  # a failed [[rewards]] is named above
        problems.append(
            'no reward: add [[rewards]] function = "my_rewards.py:correct" to the config, pass reward_fn, '
            "or set reward_model.path"
        )
    return terms, problems
