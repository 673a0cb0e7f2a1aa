"""The multi-turn part of a run, checked before launch: tools, the environment, the template, the limits.

:func:`collect_agent` gathers the tools (``Trainer(tools=...)`` and ``[[tools]]``) and the environment
(``Trainer(environment=...)`` or ``environment = "file.py:Class"``), makes the tools' schemas, checks the chat
template can append turns as token deltas, and that everything pickles (it travels to the workers by
value). Every problem comes back at once, naming the setting and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import cloudpickle

from rlkit.data.chat import ChatRenderer
from rlkit.data.envs import EnvironmentFactory, environment_problems, tool_methods
from rlkit.data.named_rewards import resolve_object
from rlkit.data.tools import Tool, make_tools

if TYPE_CHECKING:
    from rlkit.config.agent import AgentConfig
    from rlkit.config.run import RLConfig

AGENT_FIELDS = ("messages", "env_reward")
"""What the reward functions of a multi-turn run get besides the data's fields: the whole conversation (a list
of messages per trajectory) and the environment's summed rewards (0 without an environment)."""


@dataclass(frozen=True)
class Agent:
    """What every rank needs to run trajectories: the tools, the environment factory and the limits."""

    tools: tuple[Tool, ...]
    environment: EnvironmentFactory | None
    limits: AgentConfig

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, as the chat template renders them."""
        return [t.schema for t in self.tools]

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def collect_agent(
    config: RLConfig,
    tokenizer: Any,
    *,
    base_dir: str | Path | None = None,
    tools: Sequence[Callable[..., Any]] | None = None,
    environment: EnvironmentFactory | None = None,
) -> tuple[Agent | None, list[str]]:
    """The run's :class:`Agent` (None for a single-turn run: no tools, no environment) and its problems.

    ``tools`` join the config's ``[[tools]]``; ``environment`` replaces the config's ``environment``.
    """
    base = Path(base_dir) if base_dir is not None else None
    modules: dict[Path, ModuleType] = {}
    functions, problems = list(tools or []), []
    for i, spec in enumerate(config.tools):
        fn, problem = resolve_object(spec.function, base, modules)
        problems += [f'tools[{i}].function="{spec.function}": {problem}'] if problem else []
        functions += [fn] if not problem else []
    if environment is None and config.environment:
        environment, problem = resolve_object(config.environment, base, modules)
        problems += [f'environment="{config.environment}": {problem}'] if problem else []
    if not functions and environment is None:
        return None, problems
    made, tool_problems = agent_tools(functions, environment)
    problems += tool_problems + (environment_problems(environment) if environment is not None else [])
    problems += _pickle_problems(made, environment)
    agent = Agent(tuple(made), environment, config.agent)
    if config.model == "tiny":
        problems.append('model="tiny" has no chat template for tools or environments (it writes plain text): use '
                        'model="tiny-agent", the bundled model trained to call tools and play turns')  # fmt: skip
    else:
        problems += ChatRenderer(tokenizer, agent.schemas).problems()
    if config.rollout.tensor_parallel_size > 1:
        problems.append(f"rollout.tensor_parallel_size={config.rollout.tensor_parallel_size} with tools or an "
                        "environment: the ranks of a tensor-parallel engine would need the same number of turns; "
                        "multi-turn rollouts take tensor_parallel_size = 1")  # fmt: skip
    if config.data.chat_template is False:
        problems.append("data.chat_template = false, but tools and environments talk through the chat template: "
                        "set it to true (or leave it unset)")  # fmt: skip
    return agent, problems


def agent_tools(
    functions: Sequence[Callable[..., Any]], environment: EnvironmentFactory | None
) -> tuple[list[Tool], list[str]]:
    """The tools of a run and the problems making them: the functions, then, for an environment class without
    ``step``, its public methods (TRL's environment_factory: each trajectory calls its own instance)."""
    return make_tools(functions, tool_methods(environment) if inspect.isclass(environment) else [])


def _pickle_problems(tools: list[Tool], environment: EnvironmentFactory | None) -> list[str]:
    """Each tool or environment that cloudpickle cannot send to the workers, named."""
    named: list[tuple[str, Any]] = [(f"tool {t.name}", t.fn) for t in tools]
    named += [("the environment", environment)] if environment is not None else []
    problems = []
    for what, obj in named:
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is reported by name
            problems.append(
                f"{what} cannot be sent to the workers by value (cloudpickle: {type(exc).__name__}: {exc}); define "
                "it at the top level of a cell or a file, with no open files, locks, threads or connections in what "
                "it refers to"
            )
    return problems
