"""Multi-turn settings: ``[[tools]]``, ``environment`` and the limits of a trajectory (``[agent]``).

A run is multi-turn when it has tools (``[[tools]]`` or ``Trainer(tools=[...])``) or an environment
(``environment = "file.py:Class"`` or ``Trainer(environment=Class)``). Whether the files import and the
functions fit is checked by :func:`rlkit.data.load_run_data`, before launch, with the rest of the data.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.config.checks import need

TOOL_PARSERS = ("hermes", "mistral")
TOKEN_ESTIMATORS = ("reinforce++", "gae")
"""The advantage estimators that read rewards per token (``turn_rewards`` places an environment's per turn)."""
TRUNCATE_SIDES = ("left", "right", "middle")
"""Which part of a long tool result is kept (verl's ``tool_response_truncate_side``): its start, its end, or both."""
"""How tool calls are read from a model turn (``agent.tool_parser``), see :mod:`rlkit.data.tools`."""
FINISH_REASONS = {
    "stop": "the model answered without calling a tool, or the environment ended the episode",
    "length": "a model turn ran out of tokens (agent.max_turn_tokens or the trajectory's budget) before its "
    "end-of-turn token; its text is not parsed for tool calls",
    "max_turns": "agent.max_turns model turns were taken and the episode was not over (the last turn's "
    "environment reply is recorded but not appended; its tool calls are not run: status not_run)",
    "budget": "the next observation (tool results or the environment's reply) and one more model token do not "
    "fit the trajectory's budget, rollout.max_new_tokens: it is recorded but not appended (tool calls that could "
    "not fit even an empty result are not run)",
    "env_error": "the environment raised or timed out (in reset or step); the trajectory stops there, its error "
    "names the trajectory and turn",
}
"""The finish reasons of a trajectory and what each means. Failed tool calls (unparsable, unknown tool, bad
arguments, an exception, a timeout) do not end a trajectory: the model reads an error message as the tool's
result, and the call's ``status`` records what happened."""


@dataclass(kw_only=True)
class ToolSpec:
    """One ``[[tools]]`` entry: a tool function named by file or module."""

    function: str = ""
    """``"path/to/file.py:name"`` (relative to the TOML file, then the working directory) or
    ``"package.module:name"``; a function with type hints and a Google-style docstring (an ``Args:`` line per
    parameter), from which its JSON schema is made (``transformers.utils.get_json_schema``)."""

    def problems(self, prefix: str = "tools") -> list[str]:
        where, _, attr = self.function.rpartition(":")
        return (
            []
            if where.strip() and attr.strip()
            else [f'{prefix}.function="{self.function}": write "my_tools.py:calculator" or "package.module:calculator"']
        )


@dataclass(kw_only=True)
class AgentConfig:
    """The limits of a multi-turn trajectory (``[agent]``); each limit has its finish reason
    (:data:`FINISH_REASONS`). The trajectory's token budget after the prompt (model and observation tokens
    together) is ``rollout.max_new_tokens``, the response width of the batch."""

    max_turns: int = 4
    """Model turns per trajectory at most, >= 1 (finish reason "max_turns")."""
    max_turn_tokens: int = 0
    """Tokens one model turn may sample at most (finish reason "length"); 0: what is left of the budget."""
    call_timeout: float = 10.0
    """Seconds a tool call or an environment's reset, step, get_reward or close may take, > 0. A call past it gets
    status "timeout" (the model reads an error); an environment past it ends the trajectory ("env_error"). An
    async call is cancelled; Python cannot stop a thread, so a plain function runs on in the background and its
    result is dropped."""
    max_parallel_calls: int = 8
    """Tool calls of one model turn that run, >= 1 (verl's ``max_parallel_calls``); the model reads an error as the
    result of each call past it (status "over_limit")."""
    max_tool_response_tokens: int = 512
    """Tokens of a tool's result the model reads at most, >= 0 (0: all); a longer result is cut on
    ``tool_response_truncate_side``, marked "(truncated)" (verl's ``max_tool_response_length``, there in
    characters). Without a limit, one huge result ends its trajectory (finish reason "budget")."""
    tool_response_truncate_side: str = "middle"
    """What a cut result keeps: "left" (its start), "right" (its end) or "middle" (half of each)."""
    tool_parser: str = "hermes"
    """How tool calls are found in a model turn: "hermes" (Qwen, Hermes: ``<tool_call>{json}</tool_call>``) or
    "mistral" (``[TOOL_CALLS]`` then a JSON list); each call is ``{"name": ..., "arguments": {...}}``."""
    turn_rewards: bool = False
    """Put each environment step's reward on the last model token of its turn (for the per-token estimators:
    "reinforce++", "gae") instead of summing them onto the trajectory's last model token. The group estimators
    (GRPO, RLOO) see each trajectory's sum either way."""

    keep_env_errors: bool = False
    """Train on trajectories that ended with "env_error" too, with whatever reward they got. By default they leave
    the loss (an environment that failed says nothing about the model; its reward would act as a penalty), like
    ``mask_truncated``'s: their rewards still count in their group's statistics. Counted in ``agent/env_errors``;
    a rollout where more than half the trajectories hit one fails the step."""

    def problems(self, prefix: str = "agent") -> list[str]:
        p: list[str] = []
        need(p, self.max_turns >= 1, f"{prefix}.max_turns={self.max_turns}: must be >= 1")
        need(p, self.max_turn_tokens >= 0, f"{prefix}.max_turn_tokens={self.max_turn_tokens}: must be >= 0 (0 = the "
             "budget left)")  # fmt: skip
        need(p, self.call_timeout > 0, f"{prefix}.call_timeout={self.call_timeout}: must be > 0 seconds, e.g. 10")
        need(p, self.max_parallel_calls >= 1, f"{prefix}.max_parallel_calls={self.max_parallel_calls}: must be >= 1")
        need(p, self.max_tool_response_tokens >= 0, f"{prefix}.max_tool_response_tokens="
             f"{self.max_tool_response_tokens}: must be >= 0 (0 = no limit)")  # fmt: skip
        need(p, self.tool_response_truncate_side in TRUNCATE_SIDES, f"{prefix}.tool_response_truncate_side="
             f'"{self.tool_response_truncate_side}": use one of {TRUNCATE_SIDES}')  # fmt: skip
        need(p, self.tool_parser in TOOL_PARSERS, f'{prefix}.tool_parser="{self.tool_parser}": use one of '
             f"{TOOL_PARSERS}")  # fmt: skip
        return p
