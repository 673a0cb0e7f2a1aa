"""What the controllers of a trained policy share: the run's history and trackers, the fit loop, the diagnostics.

:class:`rlkit.Trainer` (RL) and :class:`rlkit.PreferenceTrainer` (DPO, KTO) build their roles on the
ranks (both an :class:`rlkit.workers.actor.ActorRole`) and define ``step()``; everything here reads
from that role group or from the rows the steps append.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit import diagnostics
from rlkit.runtime import Cluster, RoleGroup
from rlkit.tracking import Tracker, build_trackers
from rlkit.workers.actor import ActorRole
from rlkit.workers.phases import PhaseReport

logger = logging.getLogger(__name__)

SAMPLES_EVERY = 10
"""Trackers get the sample table of step 1 and of every SAMPLES_EVERY-th step."""


class PolicyTrainerBase(ABC):
    """The shared half of a trainer; a subclass calls :meth:`_start_run` first, then sets ``_policy`` and
    defines ``step() -> row`` (appending the row with :meth:`_append_row`) and ``save(path)``."""

    progress_metric = "reward/mean"
    """The history column the progress bar of :meth:`fit` shows."""

    _policy: RoleGroup[Any]

    def _start_run(self, cluster: Cluster, config: Any) -> None:
        self.cluster = cluster
        self.config = config
        self.steps_done = 0
        self.run_dir = Path(config.run_dir) / f"{config.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
        """Where this run's own files go (tracker files; the CLI's history.csv)."""
        trackers = getattr(config, "trackers", [])
        self._trackers: list[Tracker] = build_trackers(trackers, self.run_dir, config.to_dict()) if trackers else []
        self._rows: list[dict[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._worker_times: dict[str, float] = {}
        self._memory: list[dict[str, float]] = []

    @property
    def history(self) -> pd.DataFrame:
        """One row of metrics per completed step."""
        return pd.DataFrame(self._rows)

    @abstractmethod
    def step(self) -> dict[str, float]:
        """All phases of one step; appends its row to :attr:`history` and returns it."""

    @abstractmethod
    def save(self, path: Any) -> Path:
        """Write a checkpoint of this step under ``path``; returns its folder."""

    def fit(
        self, steps: int | None = None, *, progress: bool = True, on_step: Callable[[dict], None] | None = None
    ) -> pd.DataFrame:
        """Run ``steps`` steps (default ``config.steps``) with a progress bar; returns :attr:`history`.

        Validation runs every ``validation.every`` steps when the run has validation prompts, a checkpoint
        every ``checkpoint.every`` steps; ``on_step(row)`` is called after each step (the CLI prints from it).
        """
        from tqdm.auto import tqdm

        steps = self.config.steps if steps is None else steps
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        bar = tqdm(range(steps), desc="rlkit", disable=not progress)
        every, folder = self.config.checkpoint.every, self.config.checkpoint.dir
        val_every = self._validation_every()
        for _ in bar:
            row = self.step()
            if val_every and self.steps_done % val_every == 0:
                row = {**row, **self.evaluate()}
            bar.set_postfix({self.progress_metric: f"{row.get(self.progress_metric, float('nan')):.3f}"})
            if every and self.steps_done % every == 0:
                self.save(folder)
            if on_step is not None:
                on_step(row)
        return self.history

    def _warn_past_schedule(self) -> None:
        """Before a step: warn (once) when it is the first past ``config.steps``, which the learning-rate schedule
        spans; such steps run at the schedule's last value."""
        if self.steps_done == self.config.steps:
            logger.warning(
                "step %d is past config.steps=%d, which the learning-rate schedule spans: it holds its last value",
                self.steps_done + 1,
                self.config.steps,
            )

    def _validation_every(self) -> int:
        """Steps between validation passes in :meth:`fit` (0: none)."""
        return 0

    def evaluate(self) -> dict[str, float]:
        """A validation pass (trainers with validation prompts define it)."""
        raise NotImplementedError(f"{type(self).__name__} has no validation pass")

    def close(self) -> None:
        """Close the trackers (their files are complete); the trainer keeps working without them."""
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

    # -- rows and trackers -----------------------------------------------------------------------

    def _append_row(self, row: dict[str, float], samples: Callable[[], pd.DataFrame]) -> None:
        """Keep ``row`` in the history and send it to the trackers (with ``samples()`` now and then)."""
        self._rows.append(row)
        for tracker in self._trackers:
            tracker.log_metrics(self.steps_done, row)
            if self.steps_done == 1 or self.steps_done % SAMPLES_EVERY == 0:
                tracker.log_samples(self.steps_done, samples())

    def _add_to_last_row(self, metrics: dict[str, float]) -> None:
        """Merge ``metrics`` (a validation pass) into the last step's row and send them to the trackers."""
        if self._rows:
            self._rows[-1].update(metrics)
            for tracker in self._trackers:
                tracker.log_metrics(self.steps_done, metrics)

    def _record(self, phase: str, start: float, results: Sequence[PhaseReport]) -> None:
        """Keep the phase's wall time, the slowest rank's inner times, and each rank's memory."""
        self._phase_times[phase] = time.perf_counter() - start
        for name in results[0].times:
            self._worker_times[name] = max(r.times[name] for r in results)
        self._memory = [r.memory_mb for r in results]

    # -- diagnostics (each rank's plain data, combined by rlkit.diagnostics) ----------------------

    def sharding(self) -> diagnostics.Sharding:
        """How the actor is sharded (units, parameters, totals per rank; reference and engine holdings)."""
        return diagnostics.sharding(self._policy.call(ActorRole.inspect))

    def memory(self) -> pd.DataFrame:
        """Each rank's memory at the phase boundaries of the last step, broken down by what holds it."""
        return diagnostics.memory_table(self._policy.call(ActorRole.memory_marks))

    def grad_norms(self) -> diagnostics.GradNorms:
        """The last optimizer step's per-rank, per-unit gradient norms, the true global norm, disagreements."""
        reports = self._policy.call(ActorRole.grad_report)
        if any(r is None for r in reports):
            raise RuntimeError("no update has run yet: call trainer.update(batch) or trainer.step() first")
        return diagnostics.grad_norms([r for r in reports if r is not None])

    def lint(self) -> diagnostics.Findings:
        """FSDP lint over every rank's actor, optimizer, reference and rollout engine."""
        return diagnostics.lint(self._policy.call(ActorRole.inspect))
