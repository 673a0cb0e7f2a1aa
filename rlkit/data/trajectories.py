"""What a multi-turn rollout records, per trajectory and per turn, beside the batch's tensors.

Token positions are in response coordinates: column ``t`` of the batch's ``[B, T]`` tensors
(``response_mask``, ``turn_index``, ...), counted from the end of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

CALL_STATUSES = ("ok", "unparsable", "unknown_tool", "bad_arguments", "error", "timeout", "over_limit", "not_run")
"""A tool call's outcome; "over_limit" (past ``agent.max_parallel_calls``) and the failures give the model an error
message as the call's result; "not_run": its result could never be shown (the trajectory's last turn, or no room
left in its budget), so it was not run and is not a failure."""


@dataclass(kw_only=True)
class ToolCall:
    """One tool call of a model turn and what came back."""

    name: str
    """The tool called ("" when the call could not be read)."""
    arguments: dict[str, Any] | None
    """The arguments as parsed (None when the call could not be read)."""
    result: str
    """The tool message's text: the tool's result, or the error the model reads."""
    status: str
    """One of :data:`CALL_STATUSES`."""
    seconds: float = 0.0
    """Wall time of the call (the timeout for one that timed out)."""


@dataclass(kw_only=True)
class Turn:
    """One model turn and the observation that answered it."""

    index: int
    start: int
    """First response column of the model's tokens."""
    end: int
    """One past the model's last token (its end-of-turn token included)."""
    text: str
    """The model's text, its end-of-turn token left out (other special tokens kept: what a re-render shows)."""
    calls: list[ToolCall] = field(default_factory=list)
    observation: str = ""
    """The environment's reply, or the tool results, as the next turn's context shows them ("" when none)."""
    observation_end: int = 0
    """One past the observation's last token (== ``end`` when nothing was appended)."""
    reward: float = 0.0
    """The environment's reward for this turn (0 without an environment)."""
    finish: str = ""
    """How the turn ended: "tool_calls", "observation" (the environment replied) or the trajectory's finish reason."""


@dataclass(kw_only=True)
class Trajectory:
    """One multi-turn episode: its conversation, its turns, how it ended, and any template drift."""

    messages: list[dict[str, Any]]
    """The whole conversation: the prompt's messages, then assistant, tool and user (environment) messages."""
    turns: list[Turn]
    finish_reason: str
    """One of ``rlkit.config.agent.FINISH_REASONS``."""
    error: str = ""
    """Why the environment failed ("env_error"), naming the trajectory and turn; "" when it did not."""
    close_error: str = ""
    """Why the environment's ``close()`` failed, once the episode was over ("" when it did not, or has none)."""
    drift: str = ""
    """Where the token-in/token-out ids differ from the re-rendered conversation ("" when they agree)."""

    def records(self) -> list[dict[str, Any]]:
        """Each turn as plain data (what a run's ``samples/*.jsonl`` keep): its index, the model's text, its tool
        calls (name, arguments, status, result), the observation that answered it, its reward and how it ended;
        the trajectory's error and close error on its last turn."""
        return [
            {
                "turn": turn.index,
                "text": turn.text,
                "tool_calls": [{"name": c.name, "arguments": c.arguments, "status": c.status, "result": c.result}
                               for c in turn.calls],  # fmt: skip
                "observation": turn.observation,
                "reward": turn.reward,
                "finish": turn.finish,
                **({"error": self.error} if self.error and turn is self.turns[-1] else {}),
                **({"close_error": self.close_error} if self.close_error and turn is self.turns[-1] else {}),
            }
            for turn in self.turns
        ]

    @property
    def env_reward(self) -> float:
        """The environment's rewards summed over the turns."""
        return sum(t.reward for t in self.turns)

    @property
    def tool_calls(self) -> int:
        return sum(len(t.calls) for t in self.turns)

    @property
    def ran_calls(self) -> int:
        """The calls that ran and returned (status "ok")."""
        return sum(c.status == "ok" for t in self.turns for c in t.calls)

    @property
    def failed_calls(self) -> int:
        return sum(c.status not in ("ok", "not_run") for t in self.turns for c in t.calls)


def turns_frame(
    trajectories: list[Trajectory],
    turn_index: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor,
    advantages: torch.Tensor | None,
    gap: torch.Tensor | None,
    checked: torch.Tensor,
) -> pd.DataFrame:
    """One row per turn of every trajectory: the model's text and tokens, its calls and their results, the
    observation, the environment's reward, how it ended, and (where given) the turn's mean advantage and mean
    |trainer - engine| log-prob gap over its model tokens. ``turn_index``, ``response_mask``, ``advantages``, ``gap``
    and ``checked`` (the tokens with an engine log-prob) are [B, T] over the responses; ``group`` is [B]."""
    rows = []
    for i, trajectory in enumerate(trajectories):
        for turn in trajectory.turns:
            model = (turn_index[i] == turn.index) & (response_mask[i] > 0)
            rows.append({
                "trajectory": i,
                "group": int(group[i]),
                "turn": turn.index,
                "text": turn.text,
                "model_tokens": int(model.sum()),
                "tool_calls": [c.name for c in turn.calls],
                "call_status": [c.status for c in turn.calls],
                "observation": turn.observation,
                "env_reward": turn.reward,
                "finish": turn.finish,
                "error": trajectory.error if turn is trajectory.turns[-1] else "",
                "advantage": _mean(advantages, i, model),
                "logprob_gap_mean": _mean(gap, i, model & checked[i]),
            })  # fmt: skip
    return pd.DataFrame(rows)


def _mean(values: torch.Tensor | None, row: int, where: torch.Tensor) -> float:
    """The mean of ``values[row]`` over ``where`` ([T] bool); NaN when there is nothing to average."""
    if values is None or not where.any():
        return float("nan")
    return float(values[row][where].mean())
