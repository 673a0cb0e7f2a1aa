"""The controller's view of offline preference training (DPO, KTO): one optimizer step per call of ``step()``.

Each step takes the next ``batch_size`` examples (shuffled per epoch, the position kept in checkpoints),
pads them into rows, splits the rows evenly over the ranks and calls :meth:`PreferenceWorker.update` on
every rank: the reference's log-probs, the policy's forward/backward over micro-batches, the clip by the
true global norm and the optimizer step. The history, trackers, fit loop and diagnostics (sharding, memory,
grad_norms, lint) are :class:`~rlkit.trainer.base.PolicyTrainerBase`'s, as for the RL trainer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlkit import diagnostics
from rlkit.algos import kto_metrics, kto_mismatched_pairs, preference_metrics
from rlkit.config import ConfigError, PreferenceConfig, config_from_dict
from rlkit.data.files import PromptInput
from rlkit.data.preferences import load_preferences
from rlkit.data.prompts import PromptSource
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, PerRank, RoleGroup
from rlkit.trainer import checkpoints
from rlkit.trainer.assemble import preference_rows
from rlkit.trainer.base import Change, PolicyTrainerBase
from rlkit.trainer.metrics import memory_columns
from rlkit.workers import PreferenceResult, PreferenceRows, PreferenceWorker

logger = logging.getLogger(__name__)


class PreferenceTrainer(PolicyTrainerBase):
    """DPO (and IPO, reference-free DPO) or KTO, by the config's class, on a launched cluster.

    ``pairs``: a ``datasets.Dataset`` or a list of dicts with the columns prompt / chosen / rejected (DPO) or
    prompt / completion / label (KTO); files go in ``config.data.train_files``; with model="tiny" and neither,
    the shipped addition set. Every problem of the config and the data is reported before any model loads.

    :meth:`step` is one optimizer step on ``config.batch_size`` examples; :meth:`fit` runs steps with a
    progress bar; :attr:`history` holds one row of metrics per step: rewards/chosen, rewards/rejected,
    rewards/margins, rewards/accuracy (the implicit rewards beta * log(pi / pi_ref) of the step's batch,
    measured before its update), actor/loss, actor/grad_norm, actor/lr, KTO's kto/z_ref, times and memory.
    """

    progress_metric = "rewards/accuracy"

    def __init__(
        self,
        cluster: Cluster,
        config: PreferenceConfig,
        *,
        pairs: PromptInput | None = None,
        val_pairs: PromptInput | None = None,
    ):
        diagnostics.check_launch(config, cluster.world_size, cluster.device)
        self.config: PreferenceConfig = config
        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self._examples, summary = load_preferences(config, self.tokenizer, pairs=pairs)
        self._val: PromptSource | None = None
        if val_pairs is not None or config.data.val_files:
            self._val, val_summary = load_preferences(config, self.tokenizer, pairs=val_pairs, split="val")
            summary += "\n" + val_summary
        self._start_run(cluster, config)  # after the data checks: a config that cannot run opens no tracker run
        logger.info("%s", summary)
        self._last: tuple[list[dict[str, Any]], list[PreferenceResult]] | None = None
        self._policy = RoleGroup(cluster, PreferenceWorker, config, str(self.model_dir), owner=self._owner)

    def step(self) -> dict[str, float]:
        """One optimizer step on the next ``batch_size`` examples over all ranks; appends a row to
        :attr:`history` and returns it.

        Stop (KeyboardInterrupt) waits for the step to complete; a step that fails before its optimizer step leaves
        the trainer as it was (the examples it drew are drawn again), one that fails after refuses further phases
        until a resume."""
        cfg = self.config
        self._check_usable()
        self._warn_past_schedule()
        start = time.perf_counter()
        self._phase_times, self._worker_times = {}, {}
        position, done = self._examples.state_dict(), self.steps_done
        try:
            with self._changing_models("step") as change:
                row = self._step(self._examples.next(cfg.batch_size), start, change)
        except BaseException:
            if self._needs_resume is None and self.steps_done == done:  # nothing moved: draw these examples again
                self._examples.load_state_dict(position)
            raise
        return row

    def _step(self, items: list[dict[str, Any]], start: float, change: Change) -> dict[str, float]:
        rows, mismatched = self._rank_rows(items)
        results = self._policy.call(PreferenceWorker.update, PerRank(rows), PerRank(mismatched))
        change.completed = True
        self.steps_done += 1
        self._record("update", start, results)
        self._last = (items, results)
        norms = [r.metrics["actor/grad_norm"] for r in results]
        seconds = time.perf_counter() - start
        row: dict[str, float] = {
            "step": self.steps_done,
            **results[0].metrics,
            "actor/grad_norm_rank_spread": max(norms) - min(norms),
            "perf/tokens_per_s": sum(int(r.attention_mask.sum()) for r in rows) / seconds,
            "time/step": seconds,
            **{f"time/worker/{name}": value for name, value in self._worker_times.items()},
            **memory_columns(self._memory),
        }
        self._append_row(row, self.examples)
        return row

    def evaluate(self) -> dict[str, float]:
        """Score the held-out examples (``data.val_files`` or ``val_pairs``) under the policy now, no update:
        ``val/loss`` and ``val/rewards/{chosen,rejected,margins,accuracy}`` (KTO: ``val/kto/z_ref``), as
        TRL's eval metrics. After a step they also go into that step's row of :attr:`history` and the trackers."""
        if self._val is None:
            raise ValueError("no held-out examples: set data.val_files or pass PreferenceTrainer(val_pairs=...)")
        self._check_usable()
        start = time.perf_counter()
        items = self._val.items
        ranks = self.cluster.world_size
        padded = [items[i % len(items)] for i in range(-(-len(items) // ranks) * ranks)]  # equal rows per rank
        rows, mismatched = self._rank_rows(padded)
        scores = self._policy.call(PreferenceWorker.evaluate, PerRank(rows), PerRank(mismatched))
        losses = torch.cat([s.losses for s in scores])[: len(items)]  # the repeats that padded the last rank: out
        rewards = torch.cat([s.rewards for s in scores])[: len(items)]
        if rewards.shape[1] == 2:
            metrics = preference_metrics(rewards[:, 0], rewards[:, 1])
        else:
            desirable = torch.tensor([item["label"] for item in items])
            metrics = kto_metrics(rewards[:, 0], desirable, scores[0].z_ref or 0.0, self.config.beta)
        out = {"val/loss": losses.mean().item(), **{f"val/{k}": v for k, v in metrics.items()}}
        out["time/evaluate"] = time.perf_counter() - start
        self._add_to_last_row(out)
        return out

    def _can_validate(self) -> bool:
        return self._val is not None

    def _samples(self) -> pd.DataFrame:
        return self.examples()

    def _rank_rows(self, items: list[dict[str, Any]]) -> tuple[list[PreferenceRows], list[PreferenceRows | None]]:
        """Each rank's share of the rows of ``items``, and of KTO's mismatched pairs (prompt i, completion i - 1)."""
        pad, ranks = self.tokenizer.pad_token_id, self.cluster.world_size
        prompts = [item["prompt_ids"] for item in items for _ in item["completion_ids"]]
        completions = [ids for item in items for ids in item["completion_ids"]]
        labels = [item["label"] for item in items] if "label" in items[0] else None
        rows = _split(preference_rows(prompts, completions, pad, labels), ranks)
        if labels is None:
            return rows, [None] * ranks
        shifted = [completions[j] for j in kto_mismatched_pairs(len(items)).tolist()]
        return rows, [*_split(preference_rows(prompts, shifted, pad), ranks)]

    def examples(self) -> pd.DataFrame:
        """The last step's examples, one row each, with their summed log-probs under the policy (before the
        step) and the reference, and their implicit rewards beta * (policy - reference); empty before a step."""
        if self._last is None:
            return pd.DataFrame()
        items, results = self._last
        per_example = self.config.sequences_per_example
        policy = torch.cat([r.policy_logps for r in results]).view(len(items), per_example)
        reference = torch.zeros_like(policy)
        if results[0].reference_logps is not None:
            reference = torch.cat([r.reference_logps for r in results if r.reference_logps is not None])
            reference = reference.view(len(items), per_example)
        rewards = self.config.beta * (policy - reference)
        names = ["chosen", "rejected"] if per_example == 2 else ["completion"]
        table = pd.DataFrame({"prompt": [item["prompt"] for item in items]})
        for k, name in enumerate(names):
            table[name] = [item["completions"][k] for item in items]
            table[f"logps/{name}"] = policy[:, k].tolist()
            table[f"reference_logps/{name}"] = reference[:, k].tolist()
            table[f"reward/{name}"] = rewards[:, k].tolist()
        if "label" in items[0]:
            table["label"] = [item["label"] for item in items]
        return table

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint of this step into the folder ``path`` (as ``path/step-<N>``); returns its path.

        Atomic: it appears only when complete. All but the newest ``config.checkpoint.keep_last`` are dropped.
        """
        self._check_usable()
        partial = checkpoints.partial_dir(Path(path), self.steps_done)
        try:
            self._policy.call(PreferenceWorker.save, str(partial), self.config.checkpoint.export_hf)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        meta = {
            "config": self.config.to_dict(),
            "models": checkpoints.model_record(self.config.to_dict()),
            "steps_done": self.steps_done,
            "examples": self._examples.state_dict(),
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
        config: PreferenceConfig | None = None,
        pairs: PromptInput | None = None,
        val_pairs: PromptInput | None = None,
    ) -> PreferenceTrainer:
        """A trainer continuing from a checkpoint (``path`` itself or the latest complete one under it).

        The policy's weights, optimizer, schedule, RNG, step count, position in the examples and history are
        restored (the reference is the model directory's, frozen); Python data is not stored, so pass ``pairs``
        (and ``val_pairs``) again unless the run read ``data.train_files`` or the shipped set. ``config``: the run's
        settings (default: the checkpoint's), e.g. with more ``steps``; ``fit()`` runs the steps left to them.
        """
        checkpoint = checkpoints.resolve(path)
        meta = checkpoints.read_meta(checkpoint)
        config = config if config is not None else config_from_dict(meta["config"])
        if not isinstance(config, PreferenceConfig):
            raise ValueError(f"{checkpoint} is a checkpoint of a {config.algorithm} run: use rlkit.Trainer.resume")
        if problems := checkpoints.resume_problems(checkpoint, config):
            raise ConfigError(problems)
        trainer = cls(cluster, config, pairs=pairs, val_pairs=val_pairs)
        trainer._policy.call(PreferenceWorker.load, str(checkpoint))
        trainer.steps_done = meta["steps_done"]
        trainer._rows = meta["history"]
        trainer._examples.load_state_dict(meta["examples"])
        trainer._checkpoint = checkpoint
        trainer._update_hint()
        logger.info("resumed from %s at step %d", checkpoint, trainer.steps_done)
        return trainer


def _split(rows: PreferenceRows, ranks: int) -> list[PreferenceRows]:
    """``ranks`` equal consecutive shares of ``rows`` (the config checked that the batch divides)."""
    size = len(rows) // ranks
    return [rows.select(slice(r * size, (r + 1) * size)) for r in range(ranks)]
