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
import shutil
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlkit import diagnostics
from rlkit.algos import AdvantageFn, PolicyLossFn, overlong_penalty
from rlkit.config import ConfigError, PPOConfig, RLConfig, config_from_dict
from rlkit.data import load_run_data
from rlkit.data.batch import Batch
from rlkit.data.files import PromptInput
from rlkit.data.rewards import RewardError, RewardFn, WeightedReward, compute_rewards, reward_terms
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, PerRank, RoleGroup
from rlkit.trainer import agentic, checkpoints
from rlkit.trainer.advantages import estimate_advantages
from rlkit.trainer.assemble import assemble_batch, critic_rows, policy_rows, tokenize_prompts
from rlkit.trainer.base import PolicyTrainerBase
from rlkit.trainer.evaluation import evaluate_prompts
from rlkit.trainer.memory_plan import estimate_on_cluster, findings_on_cluster, plan_on_cluster
from rlkit.trainer.metrics import logprob_gap_warning, step_metrics
from rlkit.trainer.mismatch import GapFloor, certify_rows, gap_floor, probe
from rlkit.trainer.model_reward import ModelReward
from rlkit.trainer.sampling import refill_informative
from rlkit.workers import CriticWorker, PolicyWorker, RolloutResult

logger = logging.getLogger(__name__)

Rewards = RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn | tuple[RewardFn, float]]
"""One reward callable, a list of them (weight 1 each), or {name: fn or (fn, weight)}."""


class Trainer(PolicyTrainerBase):
    """GRPO or PPO (by the config's class) on a launched cluster, steppable phase by phase.

    ``rollout -> score -> advantages -> update`` is one step; :meth:`step` runs
    them in order and :meth:`fit` runs steps with a progress bar. Each phase
    returns its result and changes nothing else, so a cell can be re-run or
    inspected; only :meth:`update` changes the models.

    With ``tools`` (plain functions) or an ``environment`` (a class with ``reset(**fields)`` and ``step(text) ->
    (observation, reward, done)``), or their ``[[tools]]``/``environment`` settings, a rollout is multi-turn: each
    sample is a trajectory of model turns and the observations that answer them (see rlkit.rollout.episodes).

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
        prompts: PromptInput | None = None,
        val_prompts: PromptInput | None = None,
        advantage_fn: AdvantageFn | None = None,
        policy_loss_fn: PolicyLossFn | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment: Callable[[], Any] | None = None,
    ):
        diagnostics.check_launch(config, cluster.world_size, cluster.device, nodes=list(cluster.status()["host"]))
        self.model_dir = resolve_model_dir(config.model)
        self.plan = plan_on_cluster(cluster, config, self.model_dir)
        """The settings ``config`` left unset, chosen to fit these devices (rlkit.diagnostics.plan)."""
        config = self.plan.config
        self.config: RLConfig = config
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        run = load_run_data(config, self.tokenizer, prompts=prompts, val_prompts=val_prompts, reward_fn=reward_fn,
                            tools=list(tools or []), environment=environment)  # fmt: skip
        self._start_run(cluster, config)  # after the data checks: a config that cannot run opens no tracker run
        logger.info("%s", run.summary())
        logger.info("%s", self.plan.line)
        self._prompts, self._val, self._rewards, self.agent = run.train, run.val, run.rewards, run.agent
        self._position = self._prompts.state_dict()
        """The prompt position after the last completed step: what a checkpoint keeps (a failed step's draw not)."""
        self._advantage_fn = advantage_fn
        self._draws = 0
        """Rollouts drawn since the last completed step (refills and re-run cells included): each its own seeds."""
        self.last_batch: Batch | None = None
        self._trained: weakref.ref[Batch] | None = None
        """The batch of the last update (a second update on it is warned about)."""
        owner = self._owner
        self._policy = RoleGroup(cluster, PolicyWorker, config, str(self.model_dir), policy_loss_fn, self.agent,
                                 owner=owner)  # fmt: skip
        if (binding := self._policy.call(PolicyWorker.adapter_binding)[0]) is not None:
            logger.info("%s", binding.describe())
        self._critic: RoleGroup[CriticWorker] | None = None
        if isinstance(config, PPOConfig):
            critic_dir = resolve_model_dir(config.critic.model) if config.critic.model else self.model_dir
            self._critic = RoleGroup(cluster, CriticWorker, config, str(critic_dir), owner=owner)
        self._reward_model = ModelReward(cluster, config, owner) if config.reward_model.path else None

    @property
    def rewards(self) -> list[WeightedReward]:
        """The reward terms :meth:`score` applies besides a reward model (``reward_fn`` and ``[[rewards]]``)."""
        return list(self._rewards)

    @property
    def reward_fn(self) -> list[WeightedReward]:
        """The same as :attr:`rewards`; assign a function, a list or ``{name: (fn, weight)}`` to replace them all."""
        return self.rewards

    @reward_fn.setter
    def reward_fn(self, spec: Rewards) -> None:
        self._rewards = reward_terms(spec)

    @property
    def has_critic(self) -> bool:
        return self._critic is not None

    # -- phases ---------------------------------------------------------------------------------

    def rollout(self) -> Batch:
        """Sample the next prompts, generate ``group_size`` completions each, and score them with the actor.

        Returns a Batch with completions, engine and trainer log-probs (the latter only after the
        update with ``recompute_logprobs=False``), reference log-probs, and the critic's values with PPO.
        """
        self._check_usable()
        cfg = self.config
        start = time.perf_counter()
        position = self._prompts.state_dict()
        items = self._prompts.next(cfg.prompts_per_step)
        try:
            prompt_ids, prompt_mask = self._tokenized(items)
        except ValueError:
            self._prompts.load_state_dict(position)
            raise
        ranks = self.cluster.world_size
        seeds = self._draw_seeds()  # every rollout its own: a re-run cell or a refill samples anew
        batch, results = self._generated(items, prompt_ids, prompt_mask, seeds)
        self._record("rollout", start, results)
        if failure := agentic.env_error_failure(batch):
            self.last_batch = batch
            raise RuntimeError(failure)
        if failures := agentic.failure_summary(batch):
            logger.warning("rollout: %s", failures)
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

    def _tokenized(self, items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt items' [P, L] ids and attention mask (ValueError: a prompt longer than data.max_prompt_tokens)."""
        texts = [item["prompt"] for item in items]
        return tokenize_prompts(self.tokenizer, texts, self.config.data.max_prompt_tokens,
                                self._prompts.add_special_tokens)  # fmt: skip

    def _generated(
        self, items: list[dict], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: list[int]
    ) -> tuple[Batch, list[RolloutResult]]:
        """Each rank's share of the prompts sampled (its episodes played, with an agent) with its seed, assembled."""
        ranks = self.cluster.world_size
        per_rank = len(items) // ranks
        episodes = None if self.agent is None else agentic.episode_inputs(items)
        results = self._policy.call(
            PolicyWorker.rollout,
            PerRank(list(prompt_ids.chunk(ranks))),
            PerRank(list(prompt_mask.chunk(ranks))),
            PerRank(seeds),
            PerRank([None if episodes is None else episodes[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]),
        )
        batch = assemble_batch(self.tokenizer, items, prompt_ids, prompt_mask, results, self.config.group_size)
        return batch, results

    def _side_rollout(self, seeds: list[int]) -> Batch:
        """The next prompts sampled as :meth:`rollout` would, with ``seeds``: nothing counts a draw, the prompt stream
        is left where it was (``mismatch()``, ``certify()``)."""
        position = self._prompts.state_dict()
        try:
            items = self._prompts.next(self.config.prompts_per_step)
        finally:
            self._prompts.load_state_dict(position)
        return self._generated(items, *self._tokenized(items), seeds)[0]

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
            lengths = batch.trajectory_lengths  # what the budget counts: a trajectory's observations too
            penalty = overlong_penalty(lengths, max_new_tokens=cfg.rollout.max_new_tokens, buffer=cfg.overlong_buffer,
                                       penalty=cfg.overlong_penalty)  # fmt: skip
            scored["overlong"] = (penalty, 1.0)
        fields = batch.fields
        if self.agent is not None:  # the conversations, the environment's rewards (and their own term)
            fields, environment = agentic.reward_inputs(batch, self.agent.environment is not None)
            scored.update(environment)
        total, by_name = compute_rewards(self._rewards, batch.prompts, batch.completions, fields, scored=scored)
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
        """One critic update (PPO) and one policy update on ``batch`` across all ranks, then the weight sync; this
        completes a step, as :meth:`step` does: ``steps_done`` counts it and :attr:`history` gets its row.

        Returns the roles' named metrics (actor/loss, actor/clipfrac, actor/entropy, actor/grad_norm,
        actor/lr, actor/skipped_steps, ...; with PPO critic/loss, critic/value_clipfrac, ...), the same on every
        rank, plus actor/grad_norm_rank_spread (0 when the ranks agree).

        Stop (KeyboardInterrupt) waits for the update to complete (a second Stop abandons it); an update that ends
        early after some weights moved leaves the trainer refusing further phases until a resume.
        """
        return self._update(batch, {}, None)[0]

    def _update(
        self, batch: Batch, sampling: dict[str, float], step_start: float | None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`update`, then the step's bookkeeping; returns (the update's metrics, the history row).
        ``step_start``: when :meth:`step` began (None: the phases ran by hand, the step's time is theirs)."""
        if batch.advantages is None:
            raise ValueError("the batch has no advantages yet: call trainer.advantages(batch) first")
        if self._trained is not None and self._trained() is batch:
            logger.warning("this batch already trained step %d: updating on it again applies its gradients twice "
                           "(for more passes over one batch, set ppo_epochs)", self.steps_done)
        self._warn_past_schedule()
        with self._changing_models("update") as change:
            metrics = self._update_roles(batch)
            change.completed = True
            self.steps_done, self._draws = self.steps_done + 1, 0
            self._position = self._prompts.state_dict()
            self.last_batch, self._trained = batch, weakref.ref(batch)
            seconds = sum(self._phase_times.values()) if step_start is None else time.perf_counter() - step_start
            row = step_metrics(
                step=self.steps_done,
                batch=batch,
                update_metrics={**metrics, **sampling},
                phase_times=self._phase_times,
                worker_times=self._worker_times,
                memory=self._memory,
                step_seconds=seconds,
                gap_limit=self.config.rollout.max_logprob_gap,
            )
            self._phase_times, self._worker_times = {}, {}  # the next step's phases start counting
            self._append_row(row, batch.to_pandas)
        return metrics, row

    def _update_roles(self, batch: Batch) -> dict[str, float]:
        start = time.perf_counter()
        shards = batch.split(self.cluster.world_size)
        metrics: dict[str, float] = {}
        dropped = agentic.left_out_of_loss(self.config)
        if self._critic is not None:
            critic_rows_per_rank = [critic_rows(shard, dropped) for shard in shards]
            critic_results = self._critic.call(CriticWorker.update, PerRank(critic_rows_per_rank))
            self._record("update", start, critic_results)
            metrics.update(critic_results[0].metrics)
        engine = bool(batch.engine_checked().any())  # the engine's log-probs go along when it returned any
        rows = [policy_rows(shard, dropped, engine) for shard in shards]
        results = self._policy.call(PolicyWorker.update, PerRank(rows))
        self._record("update", start, results)
        if batch.old_logprobs is None:  # recompute_logprobs=False: the update's forward scored the rollout
            batch.old_logprobs = torch.cat([r.old_logprobs for r in results if r.old_logprobs is not None])
            if warning := logprob_gap_warning(batch, self.config.rollout.max_logprob_gap):
                logger.warning(warning)
        norms = [r.metrics["actor/grad_norm"] for r in results]
        return {**metrics, **results[0].metrics, "actor/grad_norm_rank_spread": max(norms) - min(norms)}

    def _steps_begun(self) -> list[int]:
        critic = [] if self._critic is None else self._critic.call(CriticWorker.steps_begun)
        return super()._steps_begun() + critic

    # -- loops ----------------------------------------------------------------------------------

    def step(self, batch: Batch | None = None) -> dict[str, float]:
        """All phases once; appends a row to :attr:`history` and returns it.

        Given ``batch`` (e.g. ``trainer.last_batch`` after a reward function failed), the step goes on
        from that rollout instead of generating a new one.
        """
        self._check_usable()
        cfg = self.config
        start = time.perf_counter()
        batch = self._scored(self.rollout() if batch is None else batch)
        sampling: dict[str, float] = {}
        if cfg.dynamic_sampling:
            batch, sampling = refill_informative(
                batch, self._scored_refill, groups=cfg.prompts_per_step, max_rounds=cfg.max_refill_rounds
            )
            self.last_batch = batch
        self.advantages(batch)
        return self._update(batch, sampling, start)[1]

    def evaluate(self) -> dict[str, float]:
        """Score the validation prompts now (``validation.n`` samples each at ``validation.temperature``; no
        model changes): ``val/reward/mean``, each term's mean, and pass@k for 0/1 rewards. After a step the
        figures also go into that step's row of :attr:`history` and to the trackers."""
        if self._val is None:
            raise ValueError("no validation prompts: set data.val_files or pass Trainer(val_prompts=...)")
        self._check_usable()
        start = time.perf_counter()
        seed = self.config.seed * 1_000_003 + 999_983 * (self.steps_done + 1)
        metrics = evaluate_prompts(
            self._policy, self.tokenizer, self._val, self._rewards, self._reward_model, self.config, seed
        )
        metrics["time/evaluate"] = time.perf_counter() - start
        self._add_to_last_row(metrics)
        return metrics

    def _can_validate(self) -> bool:
        return self._val is not None

    def _scored(self, batch: Batch) -> Batch:
        """``batch`` scored, kept in :attr:`last_batch` so that a reward function that fails loses nothing."""
        self.last_batch = batch
        try:
            return self.score(batch)
        except RewardError as exc:
            exc.add_note(
                "Nothing is lost: no model changed and the rollout is in trainer.last_batch. Fix the function "
                "(trainer.reward_fn = ...), then finish this step with trainer.step(trainer.last_batch)."
            )
            raise

    def _scored_refill(self, refill: int) -> Batch:
        return self._scored(self.rollout())

    def _draw_seeds(self) -> list[int]:
        """Each rank's sampling seed of the next rollout; counts the draw, so no two rollouts share seeds."""
        seeds = self._next_seeds()
        self._draws += 1
        return seeds

    def _next_seeds(self) -> list[int]:
        """Each rank's sampling seed of the next rollout: from the steps done and the draws since the last one."""
        base = self.config.seed * 1_000_003 + self.steps_done * self.cluster.world_size + self._draws * 7_919_111
        return [base + r for r in range(self.cluster.world_size)]

    def rollouts(self) -> pd.DataFrame:
        """The last step's completions, one row each (empty before the first step)."""
        return pd.DataFrame() if self.last_batch is None else self.last_batch.to_pandas()

    def _samples(self) -> pd.DataFrame:
        return self.rollouts()

    # -- diagnostics ------------------------------------------------------------------------------

    def mismatch(self, max_rows: int = 64) -> diagnostics.MismatchReport:
        """Why the rollout engine and the trainer disagree, now: a rollout of the next prompts with the next step's
        seeds (nothing trains; the prompt stream stays where it is), whose first ``max_rows`` rows each rank
        re-scores. Per token the engine's and the trainer's log-probs and their ratio, grouped by position, token id,
        rank and turn, the gap against a floor measured on the same rows, and checks that name causes (sampling
        settings, stale weights): see rlkit.diagnostics.mismatch."""
        self._check_usable()
        batch, on = self._side_rollout(self._next_seeds()), self.config.rollout_correction.enabled
        return probe(self._policy, batch, max_rows, self._decode, self._gap_history(), on)

    def certify(self, max_rows: int = 64) -> GapFloor:
        """The engine-vs-trainer gap of this model, engine and settings: :meth:`mismatch` on ``max_rows`` rows of
        fixed-seed rollouts, summarised (mean, p99 and max ``|delta|``, k3) against the floor measured on its rows, with
        the verdict: "clean" only within the floor's tolerance on every rank (rlkit.diagnostics.floor)."""
        self._check_usable()
        cfg = self.config
        batch = certify_rows(self._side_rollout, cfg.seed, self.cluster.world_size, max_rows)
        report = probe(self._policy, batch, max_rows, self._decode, self._gap_history(), cfg.rollout_correction.enabled)
        return gap_floor(report, cfg.rollout)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _gap_history(self) -> list[float]:
        """The run's rollout/logprob_gap/mean per step (the stale-weights check's evidence of a jump)."""
        column = self.history.get("rollout/logprob_gap/mean")
        return [] if column is None else column.dropna().tolist()

    def lint(self) -> diagnostics.Findings:
        """FSDP lint over every rank's actor, optimizer, reference and rollout engine, and the memory estimate's
        verdict on these devices (GPU clusters: "memory-will-not-fit" with the fixes)."""
        return diagnostics.Findings(super().lint().items + self._memory_findings().items)

    def _memory_findings(self) -> diagnostics.Findings:
        """The preflight memory estimate's findings for this config on this cluster's GPUs (none on CPU)."""
        return findings_on_cluster(self.cluster, self.config, self.model_dir)

    def estimate(self, device_memory_gib: float | None = None) -> diagnostics.MemoryEstimate:
        """The memory estimate of this run (its planned settings) on this cluster's GPUs, or on devices of
        ``device_memory_gib`` (on a CPU cluster: give it, e.g. 79.2 for an H100): each phase's GiB by term, the
        peak, whether vLLM stays awake through the update (``engine_awake``) and, where it does not fit, the fixes."""
        return estimate_on_cluster(self.cluster, self.config, self.model_dir, device_memory_gib)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of this step into the folder ``path`` (as ``path/step-<N>``); returns its path.

        Atomic: it appears only when complete. All but the newest ``config.checkpoint.keep_last`` are dropped.
        """
        self._check_usable()
        partial = checkpoints.partial_dir(Path(path), self.steps_done)
        try:
            self._policy.call(PolicyWorker.save, str(partial), self.config.checkpoint.export_hf)
            if self._critic is not None:
                self._critic.call(CriticWorker.save, str(partial))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        meta = {
            "config": self.config.to_dict(),
            "models": checkpoints.model_record(self.config.to_dict()),
            "steps_done": self.steps_done,
            "prompts": self._position,
            "history": self._rows,
        }
        self._checkpoint = checkpoints.publish(partial, self.steps_done, meta, self.config.checkpoint.keep_last)
        self._update_hint()
        return self._checkpoint

    @classmethod
    def resume(
        cls,
        cluster: Cluster,
        path: str | os.PathLike,
        *,
        config: RLConfig | None = None,
        reward_fn: Rewards | None = None,
        prompts: PromptInput | None = None,
        val_prompts: PromptInput | None = None,
        advantage_fn: AdvantageFn | None = None,
        policy_loss_fn: PolicyLossFn | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment: Callable[[], Any] | None = None,
    ) -> Trainer:
        """A trainer continuing from a checkpoint (``path`` itself or the latest complete one under it).

        Weights (actor and critic), optimizers, schedules, RNG, step count, prompt position and history
        are restored; functions and Python data are not stored, so pass reward_fn, prompts, val_prompts,
        advantage_fn, policy_loss_fn, tools and environment again unless the run used the config's (files,
        [[rewards]], [[tools]], environment) or defaults.
        ``config``: the run's settings (default: the checkpoint's), e.g. with more ``steps``; ``fit()`` then runs
        the steps left to ``config.steps``. The trainer writes into the config's ``output_dir``: the same run folder.
        A model or LoRA setting that gives the checkpoint's tensors other shapes raises ConfigError naming both,
        before anything reaches the cluster (``rlkit.trainer.checkpoints.resume_problems``).
        """
        checkpoint = checkpoints.resolve(path)
        meta = checkpoints.read_meta(checkpoint)
        config = config if config is not None else config_from_dict(meta["config"])
        if problems := checkpoints.resume_problems(checkpoint, config):  # before any worker loads a tensor
            raise ConfigError(problems)
        trainer = cls(
            cluster,
            config,
            reward_fn=reward_fn,
            prompts=prompts,
            val_prompts=val_prompts,
            advantage_fn=advantage_fn,
            policy_loss_fn=policy_loss_fn,
            tools=tools,
            environment=environment,
        )
        trainer._policy.call(PolicyWorker.load, str(checkpoint))
        if trainer._critic is not None:
            trainer._critic.call(CriticWorker.load, str(checkpoint))
        trainer.steps_done = meta["steps_done"]
        trainer._rows = meta["history"]
        trainer._prompts.load_state_dict(meta["prompts"])
        trainer._position = meta["prompts"]
        trainer._checkpoint = checkpoint
        trainer._update_hint()
        logger.info("resumed from %s at step %d", checkpoint, trainer.steps_done)
        return trainer
