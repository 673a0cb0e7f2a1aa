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

from rlkit.algos import grpo_advantages
from rlkit.config import ConfigError, GRPOConfig
from rlkit.data.batch import Batch
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import RewardFn, compute_rewards, reward_terms
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, PerRank
from rlkit.trainer import checkpoints, policy_worker
from rlkit.trainer.metrics import logprob_gap_warning, step_metrics

log = logging.getLogger(__name__)

Rewards = RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn | tuple[RewardFn, float]]


class Trainer:
    """GRPO on a launched cluster, steppable phase by phase.

    ``rollout -> score -> advantages -> update`` is one step; :meth:`step` runs
    them in order and :meth:`fit` runs steps with a progress bar. Each phase
    returns its result and changes nothing else, so a cell can be re-run or
    inspected; only :meth:`update` changes the model.
    """

    def __init__(
        self,
        cluster: Cluster,
        config: GRPOConfig,
        *,
        reward_fn: Rewards | None = None,
        prompts: Sequence[str | dict[str, Any]] | None = None,
    ):
        config.check_cluster(cluster.world_size, cluster.device)
        self.cluster = cluster
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        reward_fn, self._prompts = _task_defaults(config, reward_fn, prompts)
        self._rewards = reward_terms(reward_fn)
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self.steps_done = 0
        self.last_batch: Batch | None = None
        self._rows: list[dict[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._worker_times: dict[str, float] = {}
        self._memory: list[dict[str, float]] = []
        cluster.run(policy_worker.setup, config.to_dict(), str(self.model_dir))

    @property
    def history(self) -> pd.DataFrame:
        """One row of metrics per completed step."""
        return pd.DataFrame(self._rows)

    # -- phases ---------------------------------------------------------------------------------

    def rollout(self) -> Batch:
        """Sample the next prompts, generate ``group_size`` completions each, and score them with the actor.

        Returns a Batch with completions, engine and trainer log-probs (and reference log-probs).
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
        if warning := logprob_gap_warning(batch, cfg.rollout.max_logprob_gap):
            log.warning(warning)
        return batch

    def score(self, batch: Batch) -> Batch:
        """Apply the reward function(s); returns the batch with ``rewards`` and ``reward_terms`` filled.

        A reward function that raises or returns bad values raises RewardError; ``batch`` is untouched.
        """
        start = time.perf_counter()
        total, terms = compute_rewards(self._rewards, batch.prompts, batch.completions, batch.fields)
        batch.rewards, batch.reward_terms = total, terms
        self._phase_times["score"] = time.perf_counter() - start
        return batch

    def advantages(self, batch: Batch) -> Batch:
        """GRPO group-relative advantages from ``batch.rewards``; returns the batch with ``advantages`` filled."""
        if batch.rewards is None:
            raise ValueError("the batch has no rewards yet: call trainer.score(batch) first")
        start = time.perf_counter()
        batch.advantages = grpo_advantages(batch.rewards, self.config.group_size, scale=self.config.scale_rewards)
        self._phase_times["advantages"] = time.perf_counter() - start
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        """One policy update on ``batch`` across all ranks, then weight sync into the rollout engines.

        Returns the update's metrics (policy loss, clip fraction, KL, grad norm, per-rank agreement).
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
        results = self.cluster.run(policy_worker.update, PerRank(shards))
        self._record("update", start, results)
        stats = {k: v for k, v in results[0].items() if isinstance(v, (int, float))}
        norms = [r["grad/norm"] for r in results]
        stats["grad/norm_rank_spread"] = max(norms) - min(norms)
        return stats

    # -- loops ----------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """All phases once; appends a row to :attr:`history` and returns it."""
        start = time.perf_counter()
        self._phase_times, self._worker_times = {}, {}
        batch = self.rollout()
        self.last_batch = batch
        self.advantages(self.score(batch))
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
    ) -> Trainer:
        """A trainer continuing from a checkpoint (``path`` itself or the latest complete one under it).

        Weights, optimizer, schedule, RNG, step count, prompt position and history are restored; the
        reward function and prompts are not stored, so pass them again unless the run used the bundled task.
        """
        checkpoint = checkpoints.resolve(path)
        meta = checkpoints.read_meta(checkpoint)
        trainer = cls(cluster, GRPOConfig.from_dict(meta["config"]), reward_fn=reward_fn, prompts=prompts)
        cluster.run(policy_worker.load, str(checkpoint))
        trainer.steps_done = meta["steps_done"]
        trainer._rows = meta["history"]
        trainer._prompts.load_state_dict(meta["prompts"])
        log.info("resumed from %s at step %d", checkpoint, trainer.steps_done)
        return trainer

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
            logprobs=torch.cat([r["logprobs"] for r in results]),
            ref_logprobs=None if ref[0] is None else torch.cat(ref),
            group=torch.arange(len(items)).repeat_interleave(g),
            finish_reason=sum((r["finish_reason"] for r in results), []),
            fields=fields,
        )

    def _record(self, phase: str, start: float, results: list[dict]) -> None:
        """Keep the phase's wall time, the slowest rank's inner times, and each rank's memory."""
        self._phase_times[phase] = time.perf_counter() - start
        for name in results[0]["times"]:
            self._worker_times[name] = max(r["times"][name] for r in results)
        self._memory = [r["memory_mb"] for r in results]


def _task_defaults(config: GRPOConfig, reward_fn: Rewards | None, prompts) -> tuple[Rewards, PromptSource]:
    """Fill in the bundled task for model="tiny"; any other model needs both reward_fn and prompts."""
    if config.model != "tiny" and (reward_fn is None or prompts is None):
        missing = [n for n, v in (("reward_fn", reward_fn), ("prompts", prompts)) if v is None]
        raise ConfigError([f"{' and '.join(missing)} missing: only model='tiny' has a bundled task and reward"])
    from rlkit.data.tasks import AdditionTask, addition_reward

    source = PromptSource(prompts, seed=config.seed) if prompts is not None else PromptSource(task=AdditionTask(), seed=config.seed)
    return (reward_fn if reward_fn is not None else addition_reward), source
