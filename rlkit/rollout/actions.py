"""What follows a model turn: its tool calls run, or the environment steps; all of a turn's calls at once.

:func:`act` takes every live trajectory's finished model turn and returns, for each, the messages the model
reads next (tool results, or the environment's reply), the environment's reward, and whether the episode is
over. Failed tool calls become error messages the model reads (the call's status says why); an environment
that raises or times out ends its trajectory with the error, named by trajectory and turn.

A tool that returns None gives the model an empty result (a tool that only acts needs no return value); the
worker's log warns once per tool, in case a ``return`` was forgotten. A result whose ``str()`` raises is that
call's error, naming the tool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlkit.data.agents import Agent
from rlkit.data.envs import Environment, EnvStep, checked_step
from rlkit.data.tools import TOOL_PARSERS, ParsedCall, argument_problem, result_text
from rlkit.data.trajectories import ToolCall
from rlkit.rollout.calls import CallRunner, Job, Outcome, call

logger = logging.getLogger(__name__)
_RETURNED_NONE: set[str] = set()
"""The tools whose None result was warned about (once per tool and process)."""


@dataclass(kw_only=True)
class TurnInput:
    """A live trajectory's finished model turn."""

    name: str
    """How errors name it: "trajectory <row>, turn <k>"."""
    text: str
    """The model's text, special tokens kept (what the tool-call parser reads)."""
    clean: str
    """The same without special tokens (what the environment's step reads)."""
    environment: Environment | None
    can_show: bool = True
    """Whether tool results could still be shown to the model (not on its last turn, nor with no room left in its
    budget); when not, its calls are not run (status "not_run")."""


@dataclass(kw_only=True)
class Reaction:
    """What answers one model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """The messages appended next: tool results, or the environment's reply (none when the episode is over)."""
    observation: str = ""
    """Their text, for the record (the environment's last reply too, which is not appended)."""
    calls: list[ToolCall] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    """The episode is over: no call and no environment (the model answered), or the environment said so."""
    error: str = ""
    """The environment failed (the trajectory ends: finish reason "env_error")."""


def act(
    agent: Agent, turns: list[TurnInput], runner: CallRunner, shorten: Callable[[str], str] = str
) -> list[Reaction]:
    """The reaction to every turn: each turn's tool calls (when the agent has tools and the turn made calls; at
    most ``agent.limits.max_parallel_calls`` of them run), else its environment's step, else the end of the
    episode. All calls and steps run at once on ``runner``'s loop, each within ``agent.limits.call_timeout``
    seconds; ``shorten`` cuts each tool result to what the model may read."""
    parse = TOOL_PARSERS[agent.limits.tool_parser]
    parsed = [parse(t.text) if agent.tools else [] for t in turns]
    jobs: list[Job] = []
    owners: list[tuple[int, int]] = []  # (turn, call) of each job; call -1: the environment's step
    for i, (turn, calls) in enumerate(zip(turns, parsed, strict=True)):
        for j, parsed_call in enumerate(calls[: agent.limits.max_parallel_calls] if turn.can_show else []):
            tool = agent.tool(parsed_call.name)
            arguments = parsed_call.arguments or {}
            if not parsed_call.error and tool is not None and not argument_problem(tool, arguments):
                fn = getattr(turn.environment, tool.name) if tool.method else tool.fn  # a method: this one's own
                jobs.append(_tool_job(fn, arguments))
                owners.append((i, j))
        if not calls and turn.environment is not None and callable(getattr(turn.environment, "step", None)):
            jobs.append(_step_job(turn.environment, turn.clean))
            owners.append((i, -1))
    outcomes = dict(zip(owners, runner.run_all(jobs, agent.limits.call_timeout), strict=True))
    return [
        _reaction(agent, turn, calls, i, outcomes, shorten)
        for i, (turn, calls) in enumerate(zip(turns, parsed, strict=True))
    ]


def _tool_job(fn: Callable[..., Any], arguments: dict[str, Any]) -> Job:
    return lambda: call(fn, **arguments)


def _step_job(environment: Environment, text: str) -> Job:
    return lambda: _step(environment, text)


async def _step(environment: Environment, text: str) -> EnvStep:
    return checked_step(await call(environment.step, text))


def _reaction(
    agent: Agent,
    turn: TurnInput,
    calls: list[ParsedCall],
    i: int,
    outcomes: dict[tuple[int, int], Outcome],
    shorten: Callable[[str], str],
) -> Reaction:
    """One turn's reaction from its parsed calls and the outcomes of the jobs it ran."""
    if calls:
        records = [_call_record(agent, turn, call, j, outcomes.get((i, j)), shorten) for j, call in enumerate(calls)]
        messages = [{"role": "tool", "name": r.name, "content": r.result} for r in records]
        return Reaction(messages=messages, observation="\n".join(r.result for r in records), calls=records)
    step = outcomes.get((i, -1))
    if step is None:  # no call, no environment: the model answered
        return Reaction(done=True)
    if step.timed_out or step.error is not None:
        why = f"timed out after {step.seconds:g} s" if step.timed_out else f"{type(step.error).__name__}: {step.error}"
        return Reaction(done=True, error=f"{turn.name}: the environment's step failed: {why}")
    observation, reward, done = step.value
    messages = [] if done else [{"role": "user", "content": observation}]
    return Reaction(messages=messages, observation=observation, reward=reward, done=done)


def _call_record(
    agent: Agent, turn: TurnInput, call: ParsedCall, j: int, outcome: Outcome | None, shorten: Callable[[str], str]
) -> ToolCall:
    """The record of call ``j`` of ``turn``: what the model reads back and the call's status."""

    def record(status: str, result: str, seconds: float = 0.0) -> ToolCall:
        return ToolCall(name=call.name, arguments=call.arguments, status=status, result=result, seconds=seconds)

    tool, limit = agent.tool(call.name), agent.limits.max_parallel_calls
    if not turn.can_show:
        return record("not_run", "")
    if j >= limit:
        return record("over_limit", f"error: not run: at most {limit} call{'s' * (limit > 1)} per turn "
                      "(agent.max_parallel_calls)")  # fmt: skip
    if call.error:
        return record("unparsable", f"error: the tool call could not be read: {call.error}")
    if tool is None:
        return record("unknown_tool", f"error: no tool {call.name!r}; the tools are {[t.name for t in agent.tools]}")
    problem = argument_problem(tool, call.arguments or {})
    if problem or outcome is None:
        return record("bad_arguments", f"error: {problem}")
    if outcome.timed_out:
        return record("timeout", f"error: {call.name} took longer than {outcome.seconds:g} s", outcome.seconds)
    if outcome.error is not None:
        return record("error", f"error: {call.name} raised {type(outcome.error).__name__}: {outcome.error}",
                      outcome.seconds)  # fmt: skip
    try:
        text = result_text(outcome.value)
    except Exception as exc:  # noqa: BLE001 - the user's result failing to print is that call's error
        return record("error", f"error: {call.name} returned a {type(outcome.value).__name__} whose str() raised "
                      f"{type(exc).__name__}: {exc}; return a str", outcome.seconds)  # fmt: skip
    if outcome.value is None and call.name not in _RETURNED_NONE:
        _RETURNED_NONE.add(call.name)
        logger.warning("tool %s returned None: the model reads an empty result; if it should return something, add "
                       "the missing `return` (return \"\" to silence this)", call.name)  # fmt: skip
    return record("ok", shorten(text), outcome.seconds)
