"""Runs on every rank: what the roles send back to the controller, one typed record per call.

Tensors are on the CPU (they travel through shared memory or Ray's object store); metrics are
named where they are made and already reduced over all ranks (the same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkit.data.trajectories import Trajectory
from rlkit.workers.phases import PhaseReport


@dataclass(kw_only=True)
class RolloutResult(PhaseReport):
    """One rank's completions of its N prompts x G samples, prompt-major."""

    response_ids: torch.Tensor
    """[N*G, T] int64, padded after the end with the pad id."""
    response_mask: torch.Tensor
    """[N*G, T] float32, 1 on generated tokens (the end-of-text token included)."""
    rollout_logprobs: torch.Tensor
    """[N*G, T] float32 log-probs of the sampled tokens under the rollout engine (NaN on rows without)."""
    rollout_logprob_rows: torch.Tensor
    """[N*G] bool, True on the rows the engine returned log-probs for."""
    old_logprobs: torch.Tensor | None
    """[N*G, T] under the actor before the update (None with ``recompute_logprobs=False``)."""
    ref_logprobs: torch.Tensor | None
    """[N*G, T] under the frozen reference (None without a KL term)."""
    finish_reason: list[str]
    """N*G values, "stop" or "length" (trajectories: also rlkit.config.agent.FINISH_REASONS)."""
    response_attention: torch.Tensor | None = None
    """[N*G, T] int64 (trajectories): 1 on the model's and the observations' tokens; None: ``response_mask``."""
    turn_index: torch.Tensor | None = None
    """[N*G, T] int64 (trajectories): each token's turn, -1 on padding."""
    trajectories: list[Trajectory] | None = None
    """N*G per-trajectory records (trajectories)."""


@dataclass(kw_only=True)
class SampleResult(PhaseReport):
    """One rank's completions of its N prompts x n samples (validation: no log-probs, no training)."""

    response_ids: torch.Tensor
    """[N*n, T] int64, padded after the end with the pad id."""
    response_mask: torch.Tensor
    """[N*n, T] float32, 1 on generated tokens."""
    finish_reason: list[str]
    """N*n values, "stop" or "length"."""


@dataclass(kw_only=True)
class UpdateResult(PhaseReport):
    """One role's update on one rank."""

    metrics: dict[str, float]
    """Named metrics reduced over all ranks (actor/... or critic/...), identical on every rank."""
    old_logprobs: torch.Tensor | None = None
    """[n, T] this rank's rows' old log-probs when the update's first forward computed them, else None."""


@dataclass(kw_only=True)
class ValuesResult(PhaseReport):
    """The critic's values of one rank's rows."""

    values: torch.Tensor
    """[n, T] float32 V(s_t) per response token (0 where masked)."""


@dataclass(kw_only=True)
class PreferenceResult(PhaseReport):
    """One preference update (one optimizer step) on one rank."""

    metrics: dict[str, float]
    """rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracy (the implicit rewards before the step;
    KTO adds kto/z_ref, DPO logps/chosen and logps/rejected), actor/loss, actor/grad_norm and actor/lr: reduced
    over all ranks, identical on every rank."""
    policy_logps: torch.Tensor
    """[n] float32 summed completion log-probs of this rank's rows under the policy before the step."""
    reference_logps: torch.Tensor | None
    """[n] float32 the same under the frozen reference (None: reference-free DPO)."""


@dataclass(kw_only=True)
class PreferenceScores:
    """One rank's held-out examples scored without an update (DPO/KTO evaluation)."""

    losses: torch.Tensor
    """[n] float32 each example's loss under the policy."""
    rewards: torch.Tensor
    """[n, k] float32 implicit rewards beta * log(pi / pi_ref): DPO's chosen and rejected (k = 2), KTO's (k = 1)."""
    z_ref: float | None
    """KTO's KL baseline over all ranks' mismatched pairs (None for DPO)."""
