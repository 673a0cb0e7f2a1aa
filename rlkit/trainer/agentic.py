"""The controller's side of multi-turn runs: the workers' episode inputs, what reward functions and advantages see,
and the trajectories' metrics."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from rlkit.algos.dapo import TRUNCATED
from rlkit.config import RLConfig
from rlkit.config.agent import FINISH_REASONS
from rlkit.data.batch import Batch
from rlkit.data.loading import PROMPT_MESSAGES
from rlkit.rollout.episodes import EpisodeInput

ENV_ERROR = "env_error"
SHOWN_ERRORS = 3
"""Environment failures quoted when a rollout fails for them."""
ENVIRONMENT_TERM = "environment"
"""The reward term of an environment's rewards (each trajectory's sum over its turns), weight 1."""


def episode_inputs(items: list[dict[str, Any]]) -> list[EpisodeInput]:
    """Each prompt item's messages and its other fields (which the environment's reset gets)."""
    return [
        EpisodeInput(
            messages=item[PROMPT_MESSAGES],
            fields={k: v for k, v in item.items() if k not in ("prompt", PROMPT_MESSAGES)},
        )
        for item in items
    ]


def reward_inputs(batch: Batch, environment: bool) -> tuple[dict[str, list], dict[str, tuple[torch.Tensor, float]]]:
    """The keyword fields a multi-turn run's reward functions get (the data's, the whole conversation as
    ``messages``, the environment's summed rewards as ``env_reward``) and, with an environment, its reward term."""
    trajectories = batch.trajectories or []
    env_reward = [t.env_reward for t in trajectories]
    fields = {**batch.fields, "messages": [t.messages for t in trajectories], "env_reward": env_reward}
    scored = {ENVIRONMENT_TERM: (torch.tensor(env_reward, dtype=torch.float32), 1.0)} if environment else {}
    return fields, scored


def turn_token_rewards(batch: Batch) -> torch.Tensor:
    """[B, T] each turn's environment reward on the last model token of its turn (0 elsewhere)."""
    out = torch.zeros_like(batch.response_mask)
    for i, trajectory in enumerate(batch.trajectories or []):
        for turn in trajectory.turns:
            if turn.end > turn.start:
                out[i, turn.end - 1] += turn.reward
    return out


def trajectory_metrics(batch: Batch) -> dict[str, float]:
    """``agent/...`` figures of a multi-turn step: turns, tool calls per trajectory, the share of trajectories with a
    call that ran (``tool_use_frac``), the share of calls that failed, drift, finish reasons."""
    trajectories = batch.trajectories
    if not trajectories:
        return {}
    count = len(trajectories)
    calls = sum(t.tool_calls for t in trajectories)
    reasons = Counter(t.finish_reason for t in trajectories)
    return {
        "agent/turns/mean": sum(len(t.turns) for t in trajectories) / count,
        "agent/tool_calls/mean": calls / count,
        "agent/tool_use_frac": sum(t.ran_calls > 0 for t in trajectories) / count,
        "agent/failed_calls_frac": sum(t.failed_calls for t in trajectories) / max(calls, 1),
        "agent/env_reward/mean": sum(t.env_reward for t in trajectories) / count,
        "agent/env_errors": float(reasons[ENV_ERROR]),
        "agent/drift_frac": sum(bool(t.drift) for t in trajectories) / count,
        "agent/trajectory_length/mean": batch.trajectory_lengths.float().mean().item(),
        **{f"agent/finish/{reason}_frac": reasons[reason] / count for reason in FINISH_REASONS},
    }


def left_out_of_loss(config: RLConfig) -> tuple[str, ...]:
    """The finish reasons whose samples leave the loss: the truncated ones with ``mask_truncated``, failed
    environments unless ``agent.keep_env_errors``."""
    truncated = TRUNCATED if config.mask_truncated else ()
    return truncated + (() if config.agent.keep_env_errors else (ENV_ERROR,))


def env_error_failure(batch: Batch) -> str:
    """Why a rollout cannot train when more than half its trajectories ended with "env_error" (the environment
    cannot run on this data, or is not an environment), quoting the first errors; "" otherwise."""
    failed = [t.error for t in batch.trajectories or [] if t.finish_reason == ENV_ERROR]
    count = len(batch.trajectories or [])
    if 2 * len(failed) <= count:
        return ""
    shown = "\n  ".join(failed[:SHOWN_ERRORS])
    return (
        f"{len(failed)} of {count} trajectories ended with env_error (their environment raised or timed out), so "
        f"this step would train on almost nothing; the first:\n  {shown}\nfix the environment (or the data its "
        "reset gets); the rollout is in trainer.last_batch (batch.turns_frame() shows each turn)"
    )


def failure_summary(batch: Batch) -> str:
    """A step's failed tool calls by status, failed environments and failed closes, in one line ("" when none
    failed); each is named in its rank's log (and the calls and environments in ``batch.turns_frame()``)."""
    trajectories = batch.trajectories or []
    statuses = Counter(c.status for t in trajectories for u in t.turns for c in u.calls if c.status != "not_run")
    failed = {s: n for s, n in sorted(statuses.items()) if s != "ok"}
    errors = sum(t.finish_reason == ENV_ERROR for t in trajectories)
    unclosed = sum(bool(t.close_error) for t in trajectories)
    if not failed and not errors and not unclosed:
        return ""
    parts = [f"{sum(failed.values())} of {sum(statuses.values())} tool calls failed ("
             + ", ".join(f"{n} {s}" for s, n in failed.items()) + ")"] if failed else []  # fmt: skip
    parts += [f"{errors} of {len(trajectories)} environments failed"] if errors else []
    parts += [f"{unclosed} of {len(trajectories)} environments failed to close"] if unclosed else []
    return "; ".join(parts) + ": details in the rank logs and batch.turns_frame()"
