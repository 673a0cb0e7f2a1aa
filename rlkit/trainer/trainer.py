"""The controller's view of an RL run: one method per phase, each returning data a person can read.

Every phase is a call of a role's method on all ranks (rlkit.workers, through
rlkit.runtime.RoleGroup) between pure steps on the controller. One step:

    rollout     PolicyWorker.rollout      generate, then score with the actor / reference
                CriticWorker.values       (PPO) the critic's values of the samples
    score       reward functions          here, on the controller (a reward model: RewardModelWorker.score)
    advantages  rlkit.algos estimators    here, on the controller
    update      CriticWorker.update       (PPO) the critic's optimizer steps
                PolicyWorker.update       the actor's optimizer steps, then the weight sync into the engine
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlkit import diagnostics
from rlkit.algos import AdvantageFn, PolicyLossFn, overlong_penalty
from rlkit.config import PPOConfig, RLConfig, config_from_dict
from rlkit.data.batch import Batch
from rlkit.data.rewards import RewardError, compute_rewards, reward_terms
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, PerRank, RoleGroup
from rlkit.trainer import checkpoints
from rlkit.trainer.advantages import estimate_advantages
from rlkit.trainer.assemble import assemble_batch, critic_rows, policy_rows, tokenize_prompts
from rlkit.trainer.inputs import Rewards, task_defaults
from rlkit.trainer.metrics import logprob_gap_warning, step_metrics
from rlkit.trainer.model_reward import ModelReward
from rlkit.trainer.sampling import refill_informative
from rlkit.workers import CriticWorker, PolicyWorker
from rlkit.workers.phases import PhaseReport

logger = logging.getLogger(__name__)



class Trainer:
    """GRPO or PPO (by the config's class) on a launched cluster, steppable phase by phase.

    ``rollout -> score -> advantages -> update`` is one step; :meth:`step` runs
    them in order and :meth:`fit` runs steps with a progress bar. Each phase
    returns its result and changes nothing else, so a cell can be re-run or
    inspected; only :meth:`update` changes the models.

    ``advantage_fn(inputs: rlkit.algos.AdvantageInputs) -> (advantages, returns)``, both [B, T],
    replaces the config's estimator; ``policy_loss_fn(new_logprobs, old_logprobs, advantages,
    response_mask) -> (loss, clipped)``, all [B, T] per token, replaces PPO's clipped surrogate
    (it travels to the workers by value). See rlkit.algos for the built-in ones.

    The learning-rate schedule spans ``config.steps`` steps; steps past it (``fit(steps=N)`` beyond
    it) run at the schedule's last value (lr, or ``min_lr_ratio * lr`` for cosine), with a warning.
    """

    def __init__(
        self,
        cluster: Cluster,
        config: RLConfig,
        *,
        reward_fn: Rewards | None = None,
        prompts: Sequence[str | dict[str, Any]] | None = None,
        advantage_fn: AdvantageFn | None = None,
        policy_loss_fn: PolicyLossFn | None = None,
    ):
        config.check_cluster(cluster.world_size, cluster.device)
        self.cluster = cluster
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.reward_fn, self._prompts = task_defaults(config, reward_fn, prompts)
        self._advantage_fn = advantage_fn
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self.steps_done = 0
        self.last_batch: Batch | None = None
        self._rows: list[dict[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._worker_times: dict[str, float] = {}
        self._memory: list[dict[str, float]] = []
        self._policy = RoleGroup(cluster, PolicyWorker, config, str(self.model_dir), policy_loss_fn)
        self._critic: RoleGroup[CriticWorker] | None = None
        if isinstance(config, PPOConfig):
            critic_dir = resolve_model_dir(config.critic.model) if config.critic.model else self.model_dir
            self._critic = RoleGroup(cluster, CriticWorker, config, str(critic_dir))
        self._reward_model = ModelReward(cluster, config) if config.reward_model.path else None

    @property
    def reward_fn(self) -> Rewards | None:
        """The reward function(s) :meth:`score` applies besides a configured reward model; assign to replace them."""
        return self._reward_fn

    @reward_fn.setter
    def reward_fn(self, spec: Rewards | None) -> None:
        self._rewards = reward_terms(spec) if spec is not None else []
        self._reward_fn = spec

    @property
    def has_critic(self) -> bool:
        return self._critic is not None

    @property
    def history(self) -> pd.DataFrame:
        """One row of metrics per completed step."""
        return pd.DataFrame(self._rows)

    # -- phases ---------------------------------------------------------------------------------

    def rollout(self) -> Batch:
        """Sample the next prompts, generate ``group_size`` completions each, and score them with the actor.

        Returns a Batch with completions, engine and trainer log-probs (the latter only after the
        update with ``recompute_logprobs=False``), reference log-probs, and the critic's values with PPO.
        """
        return self._rollout(0)

    def _rollout(self, refill: int) -> Batch:
        """:meth:`rollout`; ``refill`` > 0 is dynamic sampling's extra draw of the step (own seeds and group ids)."""
        cfg = self.config
        start = time.perf_counter()
        position = self._prompts.state_dict()
        items = self._prompts.next(cfg.prompts_per_step)
        try:
            prompt_ids, prompt_mask = tokenize_prompts(
                self.tokenizer, [item["prompt"] for item in items], cfg.rollout.max_prompt_tokens
            )
        except ValueError:
            self._prompts.load_state_dict(position)
            raise
        ranks = self.cluster.world_size
        seeds = [cfg.seed * 1_000_003 + self.steps_done * ranks + refill * 7_919_111 + r for r in range(ranks)]
        results = self._policy.call(
            PolicyWorker.rollout,
            PerRank(list(prompt_ids.chunk(ranks))),
            PerRank(list(prompt_mask.chunk(ranks))),
            PerRank(seeds),
        )
        batch = assemble_batch(self.tokenizer, items, prompt_ids, prompt_mask, results, cfg.group_size)
        batch.group += refill * cfg.prompts_per_step
        self._record("rollout", start, results)
        if self._critic is not None:
            values = self._critic.call(
                CriticWorker.values,
                PerRank(list(batch.input_ids.chunk(ranks))),
                PerRank(list(batch.attention_mask.chunk(ranks))),
            )
            batch.values = torch.cat([v.values for v in values])
            self._record("rollout", start, values)
        if warning := logprob_gap_warning(batch, cfg.rollout.max_logprob_gap):
            logger.warning(warning)
        return batch

    def score(self, batch: Batch) -> Batch:
        """Apply the reward function(s); returns the batch with ``rewards`` and ``reward_terms`` filled.

        A reward function that raises or returns bad values raises RewardError; ``batch`` is untouched.
        """
        start = time.perf_counter()
        scored = {}
        if self._reward_model is not None:  # on the workers: a dead rank surfaces as WorkerDied, not as RewardError
            scores = self._reward_model(batch.prompts, batch.completions)
            scored["reward_model"] = (torch.tensor(scores), self.config.reward_model.weight)
        cfg = self.config
        if cfg.overlong_buffer:  # DAPO's soft overlong punishment, a reward term of its own
            lengths = batch.response_lengths
            penalty = overlong_penalty(lengths, max_new_tokens=cfg.rollout.max_new_tokens, buffer=cfg.overlong_buffer,
                                       penalty=cfg.overlong_penalty)  # fmt: skip
            scored["overlong"] = (penalty, 1.0)
        total, by_name = compute_rewards(self._rewards, batch.prompts, batch.completions, batch.fields, scored=scored)
        batch.rewards, batch.reward_terms = total, by_name
        self._phase_times["score"] = time.perf_counter() - start
        return batch

    def advantages(self, batch: Batch) -> Batch:
        """Per-token advantages and returns from ``batch.rewards`` (and values, KL penalty) by the config's
        estimator or ``advantage_fn``; returns the batch with ``advantages`` and ``returns`` filled."""
        if batch.rewards is None:
            raise ValueError("the batch has no rewards yet: call trainer.score(batch) first")
        start = time.perf_counter()
        batch.advantages, batch.returns = estimate_advantages(batch, self.config, self._advantage_fn)
        self._phase_times["advantages"] = time.perf_counter() - start
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        """One critic update (PPO) and one policy update on ``batch`` across all ranks, then the weight sync.

        Returns the roles' named metrics (actor/loss, actor/clipfrac, actor/entropy, actor/grad_norm,
        actor/lr, ...; with PPO critic/loss, critic/value_clipfrac, ...), the same on every rank, plus
        actor/grad_norm_rank_spread (0 when the ranks agree).
        """
        if batch.advantages is None:
            raise ValueError("the batch has no advantages yet: call trainer.advantages(batch) first")
        start = time.perf_counter()
        shards = batch.split(self.cluster.world_size)
        metrics: dict[str, float] = {}
        if self._critic is not None:
            critic_rows_per_rank = [critic_rows(shard) for shard in shards]
            critic_results = self._critic.call(CriticWorker.update, PerRank(critic_rows_per_rank))
            self._record("update", start, critic_results)
            metrics.update(critic_results[0].metrics)
        rows = [policy_rows(shard, self.config.mask_truncated) for shard in shards]
        results = self._policy.call(PolicyWorker.update, PerRank(rows))
        self._record("update", start, results)
        if batch.old_logprobs is None:  # recompute_logprobs=False: the update's forward scored the rollout
            batch.old_logprobs = torch.cat([r.old_logprobs for r in results if r.old_logprobs is not None])
            if warning := logprob_gap_warning(batch, self.config.rollout.max_logprob_gap):
                logger.warning(warning)
        norms = [r.metrics["actor/grad_norm"] for r in results]
        return {**metrics, **results[0].metrics, "actor/grad_norm_rank_spread": max(norms) - min(norms)}

    # -- loops ----------------------------------------------------------------------------------

    def step(self, batch: Batch | None = None) -> dict[str, float]:
        """All phases once; appends a row to :attr:`history` and returns it.

        Given ``batch`` (e.g. ``trainer.last_batch`` after a reward function failed), the step goes on
        from that rollout instead of generating a new one.
        """
        if self.steps_done == self.config.steps:
            logger.warning(
                "step %d is past config.steps=%d, which the learning-rate schedule spans: it holds its last value",
                self.steps_done + 1,
                self.config.steps,
            )
        cfg = self.config
        start = time.perf_counter()
        self._phase_times, self._worker_times = {}, {}
        batch = self._scored(self.rollout() if batch is None else batch)
        sampling = {}
        if cfg.dynamic_sampling:
            batch, sampling = refill_informative(
                batch, self._scored_refill, groups=cfg.prompts_per_step, max_rounds=cfg.max_refill_rounds
            )
            self.last_batch = batch
        self.advantages(batch)
        metrics = {**self.update(batch), **sampling}
        self.steps_done += 1
        row = step_metrics(
            step=self.steps_done,
            batch=batch,
            update_metrics=metrics,
            phase_times=self._phase_times,
            worker_times=self._worker_times,
            memory=self._memory,
            step_seconds=time.perf_counter() - start,
        )
        self._rows.append(row)
        return row

    def _scored(self, batch: Batch) -> Batch:
        """``batch`` scored, kept in :attr:`last_batch` so that a reward function that fails loses nothing."""
        self.last_batch = batch
        try:
            return self.score(batch)
        except RewardError as exc:
            raise RewardError(
                f"{exc}\nNothing is lost: no model changed and the rollout is in trainer.last_batch. Fix the "
                "function (trainer.reward_fn = ...), then finish this step with trainer.step(trainer.last_batch)."
            ) from exc

    def _scored_refill(self, refill: int) -> Batch:
        return self._scored(self._rollout(refill))

    def fit(
        self, steps: int | None = None, *, progress: bool = True, on_step: Callable[[dict], None] | None = None
    ) -> pd.DataFrame:
        """Run ``steps`` steps (default ``config.steps``) with a progress bar; returns :attr:`history`.

        ``on_step(row)`` is called after each step (the CLI prints from it).
        """
        from tqdm.auto import tqdm

        steps = self.config.steps if steps is None else steps
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        bar = tqdm(range(steps), desc="rlkit", disable=not progress)
        every, folder = self.config.checkpoint.every, self.config.checkpoint.dir
        for _ in bar:
            row = self.step()
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}")
            if every and self.steps_done % every == 0:
                self.save(folder)
            if on_step is not None:
                on_step(row)
        return self.history

    def rollouts(self) -> pd.DataFrame:
        """The last step's completions, one row each (empty before the first step)."""
        return pd.DataFrame() if self.last_batch is None else self.last_batch.to_pandas()

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of this step into the folder ``path`` (as ``path/step-<N>``); returns its path.

        Atomic: it appears only when complete. All but the newest ``config.checkpoint.keep_last`` are dropped.
        """
        partial = checkpoints.partial_dir(Path(path), self.steps_done)
        self._policy.call(PolicyWorker.save, str(partial), self.config.checkpoint.export_hf)
        if self._critic is not None:
            self._critic.call(CriticWorker.save, str(partial))
        meta = {
            "config": self.config.to_dict(),
            "steps_done": self.steps_done,
            "prompts": self._prompts.state_dict(),
            "history": self._rows,
        }
        return checkpoints.publish(partial, self.steps_done, meta, self.config.checkpoint.keep_last)

    @classmethod
    def resume(
        cls,
        cluster: Cluster,
        path: str | os.PathLike,
        *,
        reward_fn: Rewards | None = None,
        prompts: Sequence[str | dict[str, Any]] | None = None,
        advantage_fn: AdvantageFn | None = None,
        policy_loss_fn: PolicyLossFn | None = None,
    ) -> Trainer:
        """A trainer continuing from a checkpoint (``path`` itself or the latest complete one under it).

        Weights (actor and critic), optimizers, schedules, RNG, step count, prompt position and history
        are restored; functions are not stored, so pass reward_fn, prompts, advantage_fn and
        policy_loss_fn again unless the run used the defaults.
        """
        checkpoint = checkpoints.resolve(path)
        meta = checkpoints.read_meta(checkpoint)
        trainer = cls(
            cluster,
            config_from_dict(meta["config"]),
            reward_fn=reward_fn,
            prompts=prompts,
            advantage_fn=advantage_fn,
            policy_loss_fn=policy_loss_fn,
        )
        trainer._policy.call(PolicyWorker.load, str(checkpoint))
        if trainer._critic is not None:
            trainer._critic.call(CriticWorker.load, str(checkpoint))
        trainer.steps_done = meta["steps_done"]
        trainer._rows = meta["history"]
        trainer._prompts.load_state_dict(meta["prompts"])
        logger.info("resumed from %s at step %d", checkpoint, trainer.steps_done)
        return trainer

    # -- diagnostics (each rank's plain data, combined by rlkit.diagnostics) ----------------------

    def sharding(self) -> diagnostics.Sharding:
        """How the actor is sharded (units, parameters, totals per rank; reference and engine holdings)."""
        return diagnostics.sharding(self._policy.call(PolicyWorker.inspect))

    def memory(self) -> pd.DataFrame:
        """Each rank's memory at the phase boundaries of the last step, broken down by what holds it."""
        return diagnostics.memory_table(self._policy.call(PolicyWorker.memory_marks))

    def grad_norms(self) -> diagnostics.GradNorms:
        """The last optimizer step's per-rank, per-unit gradient norms, the true global norm, disagreements."""
        reports = self._policy.call(PolicyWorker.grad_report)
        if any(r is None for r in reports):
            raise RuntimeError("no update has run yet: call trainer.update(batch) or trainer.step() first")
        return diagnostics.grad_norms([r for r in reports if r is not None])

    def lint(self) -> diagnostics.Findings:
        """FSDP lint over every rank's actor, optimizer, reference and rollout engine."""
        return diagnostics.lint(self._policy.call(PolicyWorker.inspect))

    # -- internals ------------------------------------------------------------------------------

    def _record(self, phase: str, start: float, results: Sequence[PhaseReport]) -> None:
        """Keep the phase's wall time, the slowest rank's inner times, and each rank's memory."""
        self._phase_times[phase] = time.perf_counter() - start
        for name in results[0].times:
            self._worker_times[name] = max(r.times[name] for r in results)
        self._memory = [r.memory_mb for r in results]
