"""Everything a run reads before launch, in one call: training and validation prompts and the reward terms.

:func:`load_run_data` gathers the problems of every part (files, columns, chat template, prompt
lengths, reward files and signatures) and raises them together as one ConfigError, so a person
fixes a config in one pass and nothing expensive starts on a config that cannot run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.data import agent_tasks
from rlkit.data.agents import AGENT_FIELDS, Agent, collect_agent
from rlkit.data.envs import reset_problems
from rlkit.data.files import PromptInput
from rlkit.data.loading import PROMPT_MESSAGES, PromptReport, collect_prompts
from rlkit.data.named_rewards import collect_rewards, signature_problems
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import WeightedReward, reward_terms
from rlkit.data.tasks import AdditionTask, addition_reward

if TYPE_CHECKING:
    from rlkit.config.run import RLConfig

TASK_FIELDS = ["answer"]
"""The fields of the bundled addition task's rows (model="tiny" without data)."""
logger = logging.getLogger(__name__)

AGENT_TASK_PROMPTS = 4096
"""Prompts of the bundled two-tool task (model="tiny-agent" without data), drawn from the run's seed."""


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
    agent: Agent | None = None
    """The tools, environment and limits of a multi-turn run; None for single-turn completions."""

    def summary(self) -> str:
        """Lines for a person: each split's report and the reward terms with their weights."""
        scored = self.agent is not None and self.agent.environment is not None
        named = [f"{t.name} x {t.weight:g}" for t in self.rewards] + (["environment x 1"] if scored else [])
        terms = ", ".join(named) or "the reward model alone"
        lines = [*(r.summary() for r in self.reports), f"rewards: {terms}"]
        if self.agent is not None:
            factory = self.agent.environment
            environment = "none" if factory is None else getattr(factory, "__qualname__", repr(factory))
            limits = self.agent.limits
            lines.append(
                f"multi-turn: tools {[t.name for t in self.agent.tools]}, environment {environment}, at most "
                f"{limits.max_turns} turns, {limits.tool_parser} tool calls, {limits.call_timeout:g} s per call"
            )
        return "\n".join(lines)


def _val_source(
    config: RLConfig, tokenizer: Any, base_dir: str | Path | None, val_prompts: PromptInput | None, agent: Any,
    fields: list[str] | None,
) -> tuple[Any, Any, list[str]]:
    """The validation prompts, their report and their problems (none asked for: None, None, [])."""
    if val_prompts is None and not config.data.val_files:
        return None, None, []
    if agent is not None:
        return None, None, ["validation prompts with tools or an environment: multi-turn validation is not "
                            "supported yet; leave data.val_files empty (and val_prompts unset)"]  # fmt: skip
    val, report, problems = collect_prompts(
        config.data, tokenizer, config.seed, max_prompt_tokens=config.data.max_prompt_tokens,
        base_dir=base_dir, split="val", prompts=val_prompts,
    )
    if report is not None and fields is not None and report.fields != fields:
        problems.append(
            f"the validation data has the fields {report.fields} but the training data has {fields}: "
            "give both the same columns (the reward functions get them)"
        )
    return val, report, problems


def load_run_data(
    config: RLConfig,
    tokenizer: Any,
    *,
    base_dir: str | Path | None = None,
    prompts: PromptInput | None = None,
    val_prompts: PromptInput | None = None,
    reward_fn: Any = None,
    tools: list[Any] | None = None,
    environment: Any = None,
) -> RunData:
    """The checked prompts, rewards, tools and environment of ``config`` (``prompts``/``val_prompts``/``reward_fn``/
    ``tools``/``environment`` from Python replace or join them); relative paths are looked up in ``base_dir`` (the
    TOML file's folder), then the CWD.

    model="tiny" without data files or prompts trains on the bundled addition task, scored by
    ``addition_reward`` unless rewards are given. model="tiny-agent" without them trains on the bundled two-tool
    task (rlkit.data.agent_tasks: products and dates): the calculator and weekday tools unless tools or an
    environment are given, scored by ``answer_reward`` unless rewards are given.

    Raises:
        ConfigError: every problem of the data and the rewards at once, each naming the setting and the fix.
    """
    _check_tools_list(tools)
    if prompts is None and not config.data.train_files and config.model == "tiny-agent":
        prompts, tools, reward_fn = _bundled_agent_task(config, tools, environment, reward_fn)
    agent, problems = collect_agent(config, tokenizer, base_dir=base_dir, tools=tools, environment=environment)
    _warn_of_unknown_tools(config, agent)
    schemas = None if agent is None else agent.schemas
    opens = agent is None or agent.environment is None  # with an environment, the trajectories open the turn
    train, train_report, fields, train_problems = _train_source(config, tokenizer, base_dir, prompts, schemas, opens)
    problems += train_problems
    val, val_report, val_problems = _val_source(config, tokenizer, base_dir, val_prompts, agent, fields)
    problems += val_problems
    if fields is None and val_report is not None:
        fields = val_report.fields
    task = prompts is None and not config.data.train_files and config.model == "tiny"
    problems += _multi_turn_problems(config, agent, None if problems else train)  # no reset on broken data
    if agent is not None and fields is not None:
        problems += _agent_field_problems(fields)
        fields = [*fields, *AGENT_FIELDS]
    scored = agent is not None and agent.environment is not None
    rewards, reward_problems = _rewards(config, base_dir, fields, reward_fn, task=task, scored=scored)
    problems += reward_problems
    if problems:
        from rlkit.config import ConfigError  # lazily: config sits beside data, not below it

        raise ConfigError(list(dict.fromkeys(problems)))  # a problem both splits share is reported once
    assert train is not None
    reports = [r for r in (train_report, val_report) if r is not None]
    return RunData(train=train, val=val, rewards=rewards, reports=reports, agent=agent)


def _bundled_agent_task(
    config: RLConfig, tools: list[Any] | None, environment: Any, reward_fn: Any
) -> tuple[list[dict[str, Any]], list[Any] | None, Any]:
    """model="tiny-agent" without data: products and dates, the calculator and weekday tools unless tools or an
    environment are given, and ``answer_reward`` unless rewards are."""
    prompts = agent_tasks.tool_prompts(AGENT_TASK_PROMPTS, config.seed)
    bundled = [agent_tasks.calculator, agent_tasks.weekday]
    tools = tools if tools or environment is not None or config.tools else bundled
    reward_fn = reward_fn if reward_fn is not None or config.rewards else agent_tasks.answer_reward
    return prompts, tools, reward_fn


def _warn_of_unknown_tools(config: RLConfig, agent: Agent | None) -> None:
    """A warning when model="tiny-agent" is given tools it was not pre-trained with (``agent_tasks.TOOLS``): listed
    beside them, an unknown tool can stop it calling any (reward 0, nothing to learn from)."""
    if config.model != "tiny-agent" or agent is None:
        return
    known = [t.__name__ for t in agent_tasks.TOOLS]
    unknown = sorted({t.name for t in agent.tools} - set(known))
    if unknown:
        logger.warning(
            "model='tiny-agent' was pre-trained with the %s tools only; with %s listed it may call no tool at all "
            "(reward 0, nothing for RL to raise): train your own tools on a model of your own (see the agentic "
            "guide, 'The bundled agent')", ", ".join(known), unknown
        )


def _check_tools_list(tools: Any) -> None:
    """Raise ConfigError naming the fix when ``tools`` is one function (or anything but a list)."""
    if tools is not None and not isinstance(tools, list | tuple):
        from rlkit.config import ConfigError  # lazily: config sits beside data, not below it

        name = getattr(tools, "__name__", type(tools).__name__)
        raise ConfigError([f"tools={name}: give a list of functions, tools=[{name}]"])


def _multi_turn_problems(config: RLConfig, agent: Agent | None, train: PromptSource | None) -> list[str]:
    """[agent] without tools or an environment; an environment that cannot start on the first row of ``train``
    (None: not tried)."""
    if agent is None and config.agent != type(config.agent)():
        return ["[agent] is set, but the run has no tools and no environment, so it would run single-turn: add "
                "[[tools]] or environment (Trainer(tools=[...]) or Trainer(environment=...)), or remove "
                "[agent]"]  # fmt: skip
    if agent is None or agent.environment is None or train is None:
        return []
    return _first_row_problems(agent, train)


def _first_row_problems(agent: Agent, train: PromptSource) -> list[str]:
    """The environment made and reset on the first row of the data (a task source has no fixed rows: none)."""
    assert agent.environment is not None
    try:
        row = train.items[0]
    except TypeError:
        return []
    fields = {k: v for k, v in row.items() if k not in ("prompt", PROMPT_MESSAGES)}
    return reset_problems(agent.environment, fields, agent.limits.call_timeout)


def _agent_field_problems(fields: list[str]) -> list[str]:
    clashes = [f for f in fields if f in AGENT_FIELDS]
    return [f"the data has the column(s) {clashes}, which a multi-turn run gives its reward functions (the "
            "conversation, the environment's reward); rename them"] if clashes else []  # fmt: skip


def _train_source(
    config: RLConfig,
    tokenizer: Any,
    base_dir: str | Path | None,
    prompts: PromptInput | None,
    tools: list[Any] | None,
    generation_prompt: bool,
) -> tuple[PromptSource | None, PromptReport | None, list[str] | None, list[str]]:
    """(source, report, fields, problems); the bundled task has no report; fields are None when unknown;
    ``generation_prompt``: whether the prompts end with the template's generation prompt."""
    if prompts is None and not config.data.train_files:
        if config.model == "tiny":
            return PromptSource(task=AdditionTask(), seed=config.seed), None, TASK_FIELDS, []
        return None, None, None, [
            'data.train_files is empty: name the prompt files (or pass prompts in Python); only model="tiny" '
            "has a bundled task"
        ]
    source, report, problems = collect_prompts(
        config.data, tokenizer, config.seed, max_prompt_tokens=config.data.max_prompt_tokens,
        base_dir=base_dir, split="train", prompts=prompts, tools=tools, generation_prompt=generation_prompt,
    )
    return source, report, report.fields if report is not None else None, problems


def _rewards(
    config: RLConfig,
    base_dir: str | Path | None,
    fields: list[str] | None,
    reward_fn: Any,
    *,
    task: bool,
    scored: bool = False,
) -> tuple[list[WeightedReward], list[str]]:
    """The reward terms and their problems; signatures are checked against the fields when they are known.
    ``scored``: the run has a reward besides these (an environment's), so it may have no reward function."""
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
    if not terms and not config.rewards and not config.reward_model.path and not scored:  # failed ones named above
        problems.append(
            'no reward: add [[rewards]] function = "my_rewards.py:correct" to the config, pass reward_fn, '
            "or set reward_model.path"
        )
    return terms, problems
