"""The row of metrics each step adds to ``trainer.history`` (names: area/name[/stat])."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rlkit.algos import explained_variance, kl_estimate, masked_mean
from rlkit.data.batch import Batch
from rlkit.trainer.agentic import trajectory_metrics

PHASES = ("rollout", "score", "advantages", "update")


def step_metrics(
    *,
    step: int,
    batch: Batch,
    update_metrics: dict[str, float],
    phase_times: dict[str, float],
    worker_times: dict[str, float],
    memory: list[dict[str, float]],
    step_seconds: float,
    gap_limit: float = 0.0,
) -> dict[str, float]:
    """Flatten one step into numbers.

    ``update_metrics`` are the roles' named metrics (actor/..., critic/...); ``phase_times`` are
    controller wall seconds per phase; ``worker_times`` the slowest rank's seconds inside each
    phase (generate, logprobs, reference, update, sync); ``memory`` one dict per rank (MiB).
    ``kl/mean`` is the k3 estimate of KL(policy || reference) per response token at rollout time
    (NaN without a reference: not measured), whichever estimator the loss or reward uses. ``gap_limit`` is
    ``rollout.max_logprob_gap``: ``rollout/logprob_gap/over_limit`` is 1 on the steps whose mean gap exceeded it
    (the steps that logged the warning), else 0. Response lengths count the model's tokens;
    a multi-turn step adds ``agent/...`` (rlkit.trainer.agentic.trajectory_metrics).
    """
    lengths = batch.response_lengths.float()
    mask = batch.response_mask
    row: dict[str, float] = {
        "step": step,
        "reward/mean": batch.filled("rewards").mean().item(),
        "reward/std": batch.filled("rewards").std().item(),
        **{f"reward/{name}/mean": v.nanmean().item() for name, v in batch.reward_terms.items()},  # None: left out
        "response/length/mean": lengths.mean().item(),
        "response/length/max": lengths.max().item(),
        "response/stop_frac": sum(r == "stop" for r in batch.finish_reason) / len(batch),
        **_gap_metrics(batch, gap_limit),
        **_algorithm_metrics(batch),
        **trajectory_metrics(batch),
        **update_metrics,
        "perf/tokens_per_s": (batch.attention_mask.sum().item()) / step_seconds,
        "perf/rollout_tokens_per_s": mask.sum().item() / max(worker_times.get("generate", 0.0), 1e-9),
        "time/step": step_seconds,
        **{f"time/{p}": phase_times.get(p, 0.0) for p in PHASES},
        **{f"time/worker/{k}": v for k, v in worker_times.items()},
    }
    return {**row, **memory_columns(memory)}


def memory_columns(memory: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each rank's memory report (MiB by kind) as history columns ``memory/rank<r>/<kind>_mb``."""
    return {f"memory/rank{rank}/{kind}_mb": mib for rank, mem in enumerate(memory) for kind, mib in mem.items()}


def _gap_metrics(batch: Batch, limit: float) -> dict[str, float]:
    """The trainer-vs-engine log-prob gap over the tokens the engine returned log-probs for (NaN if none), and
    whether its mean exceeded ``limit`` (0: never)."""
    mean, gap = batch.logprob_gap_mean(), batch.logprob_gap_tokens()
    checked = batch.engine_checked()
    return {
        "rollout/logprob_gap/mean": math.nan if mean is None else mean,
        "rollout/logprob_gap/over_limit": float(bool(limit) and mean is not None and mean > limit),
        "rollout/logprob_gap/max": math.nan if mean is None or gap is None else gap.max().item(),
        "rollout/logprob_gap/checked_frac": checked.sum().item() / max(batch.response_mask.sum().item(), 1.0),
    }


def _algorithm_metrics(batch: Batch) -> dict[str, float]:
    """KL to the reference, advantage spread and, with a critic, how well its values predict the returns."""
    mask = batch.response_mask
    kl = math.nan  # not measured: no reference (kl_coef=0)
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:
        kl = masked_mean(kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k3"), mask).item()
    advantages = batch.filled("advantages")
    row = {
        "kl/mean": kl,
        "advantages/mean": masked_mean(advantages, mask).item(),
        "advantages/abs_max": (advantages * mask).abs().max().item(),
    }
    if batch.values is not None:
        returns = batch.filled("returns")
        row["critic/explained_variance"] = explained_variance(batch.values, returns, mask)
        row["critic/values/mean"] = masked_mean(batch.values, mask).item()
        row["critic/returns/mean"] = masked_mean(returns, mask).item()
    return row


def logprob_gap_warning(batch: Batch, limit: float) -> str | None:
    """A warning when the mean |trainer - rollout| log-prob over response tokens exceeds ``limit`` (0: never)."""
    gap = batch.logprob_gap_mean()
    if not limit or gap is None or gap <= limit:
        return None
    return (
        f"rollout log-probs differ from the trainer's by {gap:.4f} nats per token on average "
        f"(rollout.max_logprob_gap={limit}): the engine does not sample the trainer's distribution (a weight sync "
        "that did not take, a sampling setting the trainer does not apply, a lower-precision engine); "
        "trainer.mismatch() names the cause"
    )
