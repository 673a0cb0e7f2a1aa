"""The batch that flows through one RL step, phase by phase."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from rlkit.algos import masked_mean
from rlkit.data.trajectories import Trajectory, turns_frame


@dataclass(kw_only=True)
class Batch:
    """B completions of one step (B = prompts x group size), in group order.

    Sequences are laid out as ``[prompt (left-padded to P) | response (right-padded to T)]``.
    Fields after ``finish_reason`` are filled by later phases and are None before.

    A multi-turn run's response is a trajectory: the model's turns and, between them, the observations that
    answered them (tool results, an environment's replies). Observation tokens are attended to
    (``attention_mask`` 1) but are not the model's: ``response_mask`` is 0 on them, so they stay out of the
    loss, the log-prob gap and ``response_lengths``; ``turn_index`` and ``trajectories`` say which turn is where.
    """

    prompts: list[str]
    """B prompt texts (each repeated group-size times)."""
    completions: list[str]
    """B completion texts, decoded without special tokens."""
    input_ids: torch.Tensor
    """[B, P + T] int64 token ids, pad where the masks are 0."""
    attention_mask: torch.Tensor
    """[B, P + T] int64, 1 on real prompt and response tokens."""
    response_mask: torch.Tensor
    """[B, T] float32, 1 on the model's generated tokens (each turn's end token included); 0 on padding and on a
    trajectory's observation tokens (holes between its turns)."""
    rollout_logprobs: torch.Tensor
    """[B, T] float32 log-probs of the sampled tokens under the rollout engine; NaN on the rows the engine
    returned none for (``rollout.engine_logprobs`` < 1 asks for a fraction of the prompts only)."""
    rollout_logprob_rows: torch.Tensor | None = None
    """[B] bool, True where ``rollout_logprobs`` holds the engine's log-probs; None: every row."""
    group: torch.Tensor
    """[B] int64, the prompt index within the step (samples of one prompt share it)."""
    rank: torch.Tensor | None = None
    """[B] int64, the rank that generated each sample (None when not known)."""
    finish_reason: list[str]
    """B values, "stop" (end-of-text emitted) or "length" (hit max_new_tokens); a trajectory's may also be
    "max_turns", "budget" or "env_error" (rlkit.config.agent.FINISH_REASONS)."""
    fields: dict[str, list] = field(default_factory=dict)
    """Extra per-sample columns from the prompt source (e.g. "answer"), each of length B."""
    turn_index: torch.Tensor | None = None
    """[B, T] int64 (multi-turn runs): the model turn each response token belongs to (an observation token: the turn
    it answers), -1 on padding; None for single-turn completions."""
    trajectories: list[Trajectory] | None = None
    """B records (multi-turn runs): each trajectory's conversation, turns (text, tool calls and results, environment
    rewards), finish reason and template drift; ``completions`` then holds each one's last model turn."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] float32 log-probs under the trainer's actor before the update (PPO's old policy); filled by
    the rollout, or by the update's own forward when ``recompute_logprobs=False``."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] float32 log-probs under the frozen reference (only when kl_coef > 0)."""
    rewards: torch.Tensor | None = None
    """[B] float32 total reward (weighted sum of reward_terms)."""
    reward_terms: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward function's [B] float32 output, by name."""
    values: torch.Tensor | None = None
    """[B, T] float32 critic values V(s_t) at rollout time (PPO only)."""
    advantages: torch.Tensor | None = None
    """[B, T] float32 per-token advantages, 0 where response_mask is 0."""
    returns: torch.Tensor | None = None
    """[B, T] float32 the critic's targets (GAE returns; equal to the advantages for critic-free estimators)."""

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_length(self) -> int:
        """P, the padded prompt length."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64 number of the model's generated tokens (a trajectory's observation tokens not counted)."""
        return self.response_mask.sum(dim=1).long()

    @property
    def trajectory_lengths(self) -> torch.Tensor:
        """[B] int64 tokens after the prompt, the model's and the observations' (what the budget of
        ``rollout.max_new_tokens`` counts); equal to :attr:`response_lengths` for single-turn completions."""
        return self.attention_mask[:, self.prompt_length :].sum(dim=1).long()

    @property
    def logprobs(self) -> torch.Tensor | None:
        """Deprecated alias of :attr:`old_logprobs` (kept for one release)."""
        warnings.warn("Batch.logprobs is now Batch.old_logprobs", DeprecationWarning, stacklevel=2)
        return self.old_logprobs

    @logprobs.setter
    def logprobs(self, value: torch.Tensor | None) -> None:
        warnings.warn("Batch.logprobs is now Batch.old_logprobs", DeprecationWarning, stacklevel=2)
        self.old_logprobs = value

    def filled(self, name: str) -> torch.Tensor:
        """The tensor field ``name``, or a ValueError saying which phase fills it (rewards: ``trainer.score``;
        advantages, returns: ``trainer.advantages``; old_logprobs: the rollout or the update)."""
        value = getattr(self, name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"the batch has no {name} yet: run the phase that fills it first")
        return value

    def engine_checked(self) -> torch.Tensor:
        """[B, T] bool: response tokens whose engine log-prob is known (what the gap check compares)."""
        rows = self.rollout_logprob_rows
        checked = self.response_mask > 0
        return checked if rows is None else checked & rows[:, None]

    def logprob_gap_tokens(self) -> torch.Tensor | None:
        """[B, T] ``|trainer - rollout engine|`` log-prob of each sampled token (0 where masked or not checked), or
        None before the trainer scored the rollout. The engine sampled with the weights it holds and the trainer
        scores with its own, so a weight sync that did not take (or a precision mismatch) shows up here."""
        if self.old_logprobs is None:
            return None
        return torch.where(self.engine_checked(), (self.old_logprobs - self.rollout_logprobs).abs(), 0.0)

    def logprob_gap(self) -> torch.Tensor | None:
        """[B] the largest :meth:`logprob_gap_tokens` of each response (NaN where not checked), or None before
        the trainer's pass."""
        gap = self.logprob_gap_tokens()
        return None if gap is None else self._per_checked_row(gap.max(dim=1).values)

    def logprob_gap_mean(self) -> float | None:
        """The mean of :meth:`logprob_gap_tokens` over the checked response tokens (nats per token), or None
        before the trainer's pass or when no token was checked."""
        gap, checked = self.logprob_gap_tokens(), self.engine_checked()
        return None if gap is None or not checked.any() else float(masked_mean(gap, checked))

    def _per_checked_row(self, values: torch.Tensor) -> torch.Tensor:
        """[B] ``values`` with NaN on the rows without engine log-probs."""
        rows = self.rollout_logprob_rows
        return values if rows is None else torch.where(rows, values, torch.nan)

    def split(self, parts: int) -> list[Batch]:
        """``parts`` contiguous, equal slices (B must divide; groups stay whole when parts divides the prompts)."""
        if len(self) % parts:
            raise ValueError(f"a batch of {len(self)} samples does not split into {parts} equal parts")
        size = len(self) // parts
        return [self._slice(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def select(self, rows: torch.Tensor) -> Batch:
        """The samples at ``rows`` ([k] int64 indices, in that order)."""
        return self._slice(rows.tolist())

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Join batches in order (slices made by :meth:`split`, or rollouts of the same response width T);
        prompts padded to different widths are left-padded to the widest (id 0, mask 0)."""
        width = max(b.input_ids.shape[1] for b in batches)
        batches = [b._left_padded(width) for b in batches]
        first = batches[0]
        out: dict[str, Any] = {}
        for f in dataclasses.fields(Batch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "fields":
                out[f.name] = {k: sum((v[k] for v in values), []) for k in first.fields}
            elif f.name == "reward_terms":
                out[f.name] = {k: torch.cat([v[k] for v in values]) for k in first.reward_terms}
            elif values[0] is None:
                out[f.name] = None
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            else:
                out[f.name] = sum(values, [])
        return Batch(**out)

    def _slice(self, index: slice | list[int]) -> Batch:
        def take(value: Any) -> Any:
            if isinstance(value, torch.Tensor) or isinstance(index, slice):
                return value[index]
            return [value[i] for i in index]

        out: dict[str, Any] = {}
        for f in dataclasses.fields(Batch):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out[f.name] = {k: take(v) for k, v in value.items()}
            elif value is None:
                out[f.name] = None
            else:
                out[f.name] = take(value)
        return Batch(**out)

    def _left_padded(self, width: int) -> Batch:
        """This batch with ``input_ids`` and ``attention_mask`` left-padded to ``width`` columns."""
        extra = width - self.input_ids.shape[1]
        if extra == 0:
            return self
        pad = torch.nn.functional.pad
        return dataclasses.replace(
            self, input_ids=pad(self.input_ids, (extra, 0)), attention_mask=pad(self.attention_mask, (extra, 0))
        )

    def turns_frame(self) -> pd.DataFrame:
        """One row per turn of every trajectory (multi-turn runs): see ``rlkit.data.trajectories.turns_frame``."""
        if self.trajectories is None or self.turn_index is None:
            raise ValueError("this batch holds single-turn completions: it has no turns (run with tools or an "
                             "environment)")
        return turns_frame(self.trajectories, self.turn_index, self.response_mask, self.group, self.advantages,
                           self.logprob_gap_tokens(), self.engine_checked())  # fmt: skip

    def to_pandas(self) -> pd.DataFrame:
        """One row per completion (per trajectory in a multi-turn run: ``completion`` is its last model turn, with its
        turns, tool calls, environment reward and drift, the whole conversation as ``messages`` and each turn's
        record as ``trajectory``): what a person reads to judge a step."""
        lengths = self.response_lengths
        columns: dict[str, list] = {
            "group": self.group.tolist(),
            **({} if self.rank is None else {"rank": self.rank.tolist()}),
            "prompt": self.prompts,
            "completion": self.completions,
            "length": lengths.tolist(),
            "finish_reason": self.finish_reason,
        }
        columns.update(self.fields)
        for name, values in self.reward_terms.items():
            columns[f"reward/{name}"] = values.tolist()
        if self.rewards is not None:
            columns["reward"] = self.rewards.tolist()
        if self.values is not None:
            columns["value"] = self.values[:, 0].tolist()
        if self.advantages is not None:
            columns["advantage"] = masked_mean(self.advantages, self.response_mask, dim=1).tolist()
        if self.trajectories is not None:
            columns["turns"] = [len(t.turns) for t in self.trajectories]
            columns["tool_calls"] = [t.tool_calls for t in self.trajectories]
            columns["failed_calls"] = [t.failed_calls for t in self.trajectories]
            columns["env_reward"] = [t.env_reward for t in self.trajectories]
            columns["drift"] = [t.drift for t in self.trajectories]
            columns["messages"] = [t.messages for t in self.trajectories]
            columns["trajectory"] = [t.records() for t in self.trajectories]
        checked = self.engine_checked()
        rollout_mean = masked_mean(self.rollout_logprobs, checked, dim=1)
        columns["rollout_logprob_mean"] = self._per_checked_row(rollout_mean).tolist()
        gap_tokens = self.logprob_gap_tokens()
        if gap_tokens is not None:
            columns["logprob_gap_max"] = self._per_checked_row(gap_tokens.max(dim=1).values).tolist()
            columns["logprob_gap_mean"] = self._per_checked_row(masked_mean(gap_tokens, checked, dim=1)).tolist()
        return pd.DataFrame(columns)

