"""The controller's view of an RL run: one method per phase, each returning data a person can read."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlkit import diagnostics
from rlkit.algos import AdvantageFn
from rlkit.config import ConfigError, PPOConfig, RLConfig, config_from_dict
from rlkit.data.batch import Batch
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import RewardError, RewardFn, WeightedReward, compute_rewards, reward_terms
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, PerRank
from rlkit.trainer import checkpoints, critic, diagnose, policy_worker, reward_model
from rlkit.trainer.estimate import estimate_advantages
from rlkit.trainer.metrics import logprob_gap_warning, step_metrics
from rlkit.trainer.objective import PolicyLossFn

log = logging.getLogger(__name__)

Rewards = RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn | tuple[RewardFn, float]]


class Trainer:
    """GRPO or PPO (by the config's class) on a launched cluster, steppable phase by phase.

    ``rollout -> score -> advantages -> update`` is one step; :meth:`step` runs
    them in order and :meth:`fit` runs steps with a progress bar. Each phase
    returns its result and changes nothing else, so a cell can be re-run or
    inspected; only :meth:`update` changes the models.

    ``advantage_fn(inputs: rlkit.algos.AdvantageInputs) -> (advantages, returns)``, both [B, T],
    replaces the config's estimator; ``policy_loss_fn(logprobs, old_logprobs, advantages,
    response_mask) -> (loss, clipped)``, all [B, T] per token, replaces PPO's clipped surrogate
    (it travels to the workers by value). See rlkit.algos for the built-in ones.
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
        self.reward_fn, self._prompts = _task_defaults(config, reward_fn, prompts)
        self._model_rewards: list[WeightedReward] = []
        self._advantage_fn = advantage_fn
        self.has_critic = isinstance(config, PPOConfig)
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self.steps_done = 0
        self.last_batch: Batch | None = None
        self._rows: list[dict[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._worker_times: dict[str, float] = {}
        self._memory: list[dict[str, float]] = []
        cluster.run(policy_worker.setup, config.to_dict(), str(self.model_dir), policy_loss_fn)
        if self.has_critic:
            cluster.run(critic.setup, config.to_dict(), str(self.model_dir))
        if config.reward_model.path:
            cluster.run(reward_model.setup, config.to_dict())
            rm = reward_model.ModelReward(cluster)
            self._model_rewards = [WeightedReward("reward_model", rm, config.reward_model.weight)]

    @property
    def reward_fn(self) -> Rewards | None:
        """The reward function(s) :meth:`score` applies besides a configured reward model; assign to replace them."""
        return self._reward_fn

    @reward_fn.setter
    def reward_fn(self, spec: Rewards | None) -> None:
        self._rewards = reward_terms(spec) if spec is not None else []
        self._reward_fn = spec

    @property
    def history(self) -> pd.DataFrame:
        """One row of metrics per completed step."""
        return pd.DataFrame(self._rows)

    # -- phases ---------------------------------------------------------------------------------

    def rollout(self) -> Batch:
        """Sample the next prompts, generate ``group_size`` completions each, and score them with the actor.

        Returns a Batch with completions, engine and trainer log-probs (the latter only after the
        update with ``recompute_logprobs=False``; and reference log-probs, and the critic's values with PPO).
        """
        cfg = self.config
        start = time.perf_counter()
        position = self._prompts.state_dict()
        items = self._prompts.next(cfg.prompts_per_step)
        try:
            prompt_ids, prompt_mask = self._tokenize([item["prompt"] for item in items])
        except ValueError:
            self._prompts.load_state_dict(position)
            raise
        ranks = self.cluster.world_size
        seeds = [cfg.seed * 1_000_003 + self.steps_done * ranks + r for r in range(ranks)]
        results = self.cluster.run(
            policy_worker.rollout,
            PerRank(list(prompt_ids.chunk(ranks))),
            PerRank(list(prompt_mask.chunk(ranks))),
            PerRank(seeds),
        )
        batch = self._assemble(items, prompt_ids, prompt_mask, results)
        self._record("rollout", start, results)
        if self.has_critic:
            values = self.cluster.run(
                critic.values, PerRank(list(batch.input_ids.chunk(ranks))), PerRank(list(batch.attention_mask.chunk(ranks)))
            )
            batch.values = torch.cat([v["values"] for v in values]) * batch.response_mask
            self._record("rollout", start, values)
        if warning := logprob_gap_warning(batch, cfg.rollout.max_logprob_gap):
            log.warning(warning)
        return batch

    def score(self, batch: Batch) -> Batch:
        """Apply the reward function(s); returns the batch with ``rewards`` and ``reward_terms`` filled.

        A reward function that raises or returns bad values raises RewardError; ``batch`` is untouched.
        """
        start = time.perf_counter()
        terms = self._rewards + self._model_rewards
        total, terms = compute_rewards(terms, batch.prompts, batch.completions, batch.fields)
        batch.rewards, batch.reward_terms = total, terms
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
        """One critic update (PPO) and one policy update on ``batch`` across all ranks, then weight sync.

        Returns the update's metrics (policy loss, clip fraction, entropy, grad norm, per-rank
        agreement; with PPO the critic's loss and value clip fraction).
        """
        if batch.advantages is None:
            raise ValueError("the batch has no advantages yet: call trainer.advantages(batch) first")
        start = time.perf_counter()
        shards = [
            {
                "input_ids": s.input_ids,
                "attention_mask": s.attention_mask,
                "response_mask": s.response_mask,
                "logprobs": s.logprobs,
                "ref_logprobs": s.ref_logprobs,
                "advantages": s.advantages,
            }
            for s in batch.split(self.cluster.world_size)
        ]
        critic_stats = {}
        if self.has_critic:
            critic_shards = [
                {k: getattr(s, k) for k in ("input_ids", "attention_mask", "response_mask", "values", "returns")}
                for s in batch.split(self.cluster.world_size)
            ]
            critic_results = self.cluster.run(critic.update, PerRank(critic_shards))
            self._record("update", start, critic_results)
            critic_stats = {k: v for k, v in critic_results[0].items() if isinstance(v, (int, float))}
        results = self.cluster.run(policy_worker.update, PerRank(shards))
        self._record("update", start, results)
        if batch.logprobs is None:  # recompute_logprobs=False: the update's forward scored the rollout
            batch.logprobs = torch.cat([r["logprobs"] for r in results])
            if warning := logprob_gap_warning(batch, self.config.rollout.max_logprob_gap):
                log.warning(warning)
        stats = {**critic_stats, **{k: v for k, v in results[0].items() if isinstance(v, (int, float))}}
        norms = [r["grad/norm"] for r in results]
        stats["grad/norm_rank_spread"] = max(norms) - min(norms)
        return stats

    # -- loops ----------------------------------------------------------------------------------

    def step(self, batch: Batch | None = None) -> dict[str, float]:
        """All phases once; appends a row to :attr:`history` and returns it.

        Given ``batch`` (e.g. ``trainer.last_batch`` after a reward function failed), the step goes on
        from that rollout instead of generating a new one.
        """
        start = time.perf_counter()
        self._phase_times, self._worker_times = {}, {}
        if batch is None:
            batch = self.rollout()
        self.last_batch = batch
        try:
            self.score(batch)
        except RewardError as exc:
            raise RewardError(
                f"{exc}\nNothing is lost: no model changed and the rollout is in trainer.last_batch. Fix the "
                "function (trainer.reward_fn = ...), then finish this step with trainer.step(trainer.last_batch)."
            ) from exc
        self.advantages(batch)
        stats = self.update(batch)
        self.steps_done += 1
        row = step_metrics(
            step=self.steps_done,
            batch=batch,
            update_stats=stats,
            phase_times=self._phase_times,
            worker_times=self._worker_times,
            memory=self._memory,
            step_seconds=time.perf_counter() - start,
        )
        self._rows.append(row)
        return row

    def fit(self, steps: int | None = None, *, progress: bool = True, on_step: Callable[[dict], None] | None = None) -> pd.DataFrame:
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
        root = Path(path)
        partial = checkpoints.partial_dir(root, self.steps_done)
        self.cluster.run(policy_worker.save, str(partial), self.config.checkpoint.export_hf)
        if self.has_critic:
            self.cluster.run(critic.save, str(partial))
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
        cluster.run(policy_worker.load, str(checkpoint))
        if trainer.has_critic:
            cluster.run(critic.load, str(checkpoint))
        trainer.steps_done = meta["steps_done"]
        trainer._rows = meta["history"]
        trainer._prompts.load_state_dict(meta["prompts"])
        log.info("resumed from %s at step %d", checkpoint, trainer.steps_done)
        return trainer

    # -- diagnostics (rlkit.diagnostics on every rank, combined here) ----------------------------

    def sharding(self) -> diagnostics.Sharding:
        """How the actor is sharded (units, parameters, totals per rank; reference and engine holdings)."""
        return diagnose.sharding(self.cluster)

    def memory(self) -> pd.DataFrame:
        """Each rank's memory at the phase boundaries of the last step, broken down by what holds it."""
        return diagnose.memory(self.cluster)

    def grad_norms(self) -> diagnostics.GradNorms:
        """The last optimizer step's per-rank, per-unit gradient norms, the true global norm, disagreements."""
        return diagnose.grad_norms(self.cluster)

    def lint(self) -> diagnostics.Findings:
        """FSDP lint over every rank's actor, optimizer, reference and rollout engine."""
        return diagnose.lint(self.cluster)

    # -- internals ------------------------------------------------------------------------------

    def _tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, P] left-padded ids and mask; raises ValueError naming every prompt that is too long."""
        limit = self.config.rollout.max_prompt_tokens
        lengths = [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
        bad = [f"prompt {i} ({n} tokens): {texts[i][:60]!r}" for i, n in enumerate(lengths) if n > limit or n == 0]
        if bad:
            raise ValueError(
                f"{len(bad)} prompt(s) are empty or longer than rollout.max_prompt_tokens={limit}; "
                "shorten them or raise the limit:\n" + "\n".join(f"  - {b}" for b in bad)
            )
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    def _assemble(self, items: list[dict], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, results: list[dict]) -> Batch:
        g = self.config.group_size
        response_ids = torch.cat([r["response_ids"] for r in results])
        ref = [r["ref_logprobs"] for r in results]
        scored = [r["logprobs"] for r in results]
        fields = {k: [item[k] for item in items for _ in range(g)] for k in items[0] if k != "prompt"}
        return Batch(
            prompts=[item["prompt"] for item in items for _ in range(g)],
            completions=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            input_ids=torch.cat([prompt_ids.repeat_interleave(g, dim=0), response_ids], dim=1),
            attention_mask=torch.cat(
                [prompt_mask.repeat_interleave(g, dim=0), torch.cat([r["response_mask"] for r in results]).long()], dim=1
            ),
            response_mask=torch.cat([r["response_mask"] for r in results]),
            rollout_logprobs=torch.cat([r["rollout_logprobs"] for r in results]),
            logprobs=None if scored[0] is None else torch.cat(scored),
            ref_logprobs=None if ref[0] is None else torch.cat(ref),
            group=torch.arange(len(items)).repeat_interleave(g),
            rank=torch.cat([torch.full((len(r["response_ids"]),), i) for i, r in enumerate(results)]),
            finish_reason=sum((r["finish_reason"] for r in results), []),
            fields=fields,
        )

    def _record(self, phase: str, start: float, results: list[dict]) -> None:
        """Keep the phase's wall time, the slowest rank's inner times, and each rank's memory."""
        self._phase_times[phase] = time.perf_counter() - start
        for name in results[0]["times"]:
            self._worker_times[name] = max(r["times"][name] for r in results)
        self._memory = [r["memory_mb"] for r in results]


def _task_defaults(config: RLConfig, reward_fn: Rewards | None, prompts) -> tuple[Rewards | None, PromptSource]:
    """Fill in the bundled task for model="tiny"; any other model needs prompts, and reward_fn unless a
    reward model is configured. With a reward model and no reward_fn, the reward model alone scores."""
    has_rm = bool(config.reward_model.path)
    missing = [n for n, absent in (("reward_fn", reward_fn is None and not has_rm), ("prompts", prompts is None)) if absent]
    if config.model != "tiny" and missing:
        raise ConfigError([f"{' and '.join(missing)} missing: only model='tiny' has a bundled task and reward"])
    from rlkit.data.tasks import AdditionTask, addition_reward

    source = PromptSource(prompts, seed=config.seed) if prompts is not None else PromptSource(task=AdditionTask(), seed=config.seed)
    if reward_fn is None and not has_rm:
        reward_fn = addition_reward
    return reward_fn, source
