"""What the controllers of a trained policy share: the run's history and trackers, the fit loop, the diagnostics.

:class:`rlkit.Trainer` (RL) and :class:`rlkit.PreferenceTrainer` (DPO, KTO) build their roles on the
ranks (both an :class:`rlkit.workers.actor.ActorRole`) and define ``step()``; everything here reads
from that role group or from the rows the steps append.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit import diagnostics
from rlkit.runtime import Cluster, RoleGroup, RoleOwner
from rlkit.tracking import Tracker, build_trackers
from rlkit.trainer import checkpoints
from rlkit.trainer.outputs import HISTORY, HistoryFile, checkpoint_folder, output_folder, write_config, write_samples
from rlkit.trainer.safety import NeedsResume, interrupts_held
from rlkit.workers.actor import ActorRole
from rlkit.workers.phases import PhaseReport

logger = logging.getLogger(__name__)

SAMPLES_EVERY = 10
"""Trackers get the sample table of step 1 and of every SAMPLES_EVERY-th step."""

@dataclasses.dataclass
class Change:
    """A phase that changes the models (:meth:`PolicyTrainerBase._changing_models`): did its role calls complete?"""

    completed: bool = False


_numbers = itertools.count(1)
"""The numbers that tell this process's trainers apart in messages (``Trainer #2``)."""


class PolicyTrainerBase(ABC):
    """The shared half of a trainer; a subclass calls :meth:`_start_run` first, then sets ``_policy`` and
    defines ``step() -> row`` (appending the row with :meth:`_append_row`) and ``save(path)``."""

    progress_metric = "reward/mean"
    """The history column the progress bar of :meth:`fit` shows."""

    _policy: RoleGroup[Any]

    def _start_run(self, cluster: Cluster, config: Any) -> None:
        self.cluster = cluster
        self.name = f"{type(self).__name__} #{next(_numbers)}"
        """What messages call this trainer (a newer one on the same cluster replaces its roles)."""
        self._owner = RoleOwner(self.name)
        """The holder of this trainer's roles on the cluster: pass ``owner=self._owner`` to every RoleGroup."""
        self._needs_resume: str | None = None
        self._checkpoint: Path | None = None
        self._update_hint()
        self.output_dir = output_folder(config)
        """The run's folder (history.csv, config.toml, samples/, trackers, checkpoints/), or None: no files."""
        if self.output_dir is not None and not config.output_dir:  # checkpoints name it: a resume writes there too
            config = dataclasses.replace(config, output_dir=str(self.output_dir))
        self.config = config
        self.steps_done = 0
        self._history_file = None if self.output_dir is None else HistoryFile(self.output_dir / HISTORY)
        self._trackers: list[Tracker] | None = None  # started with the first row: a resumed run continues its step
        self._rows: list[dict[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._worker_times: dict[str, float] = {}
        self._memory: list[dict[str, float]] = []
        if self.output_dir is not None:
            write_config(self.output_dir, config)

    @property
    def history(self) -> pd.DataFrame:
        """One row of metrics per completed step (and one of step 0 with validation.before_training)."""
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
        """Run up to ``config.steps`` steps in all (after a resume, the ones left), or ``steps`` more; with a
        progress bar; returns :attr:`history`.

        Validation runs every ``validation.every`` steps when the run has validation data (and once before the first
        step with ``validation.before_training``), a checkpoint every ``checkpoint.every`` steps and at the
        ``config.steps``-th; ``on_step(row)`` is called after each step (the CLI prints from it). With an output
        folder, history.csv is rewritten after every step and the last step's samples are kept in ``samples/``.
        """
        from tqdm.auto import tqdm

        if steps is not None and steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        steps = self.config.steps - self.steps_done if steps is None else steps
        if steps < 1:
            logger.info("steps_done=%d: config.steps is reached, nothing to run (fit(steps=N) runs N more)",
                        self.steps_done)  # fmt: skip
            return self.history
        val_every = self.config.validation.every if self._can_validate() else 0
        if self._can_validate() and self.steps_done == 0 and self.config.validation.before_training:
            row = self._baseline()  # 1. the validation data before any update (step 0)
            if on_step is not None:
                on_step(row)
        bar = tqdm(range(steps), desc="rlkit", disable=not progress)
        every, folder = self.config.checkpoint.every, checkpoint_folder(self.config, self.output_dir)
        for _ in bar:
            row = self.step()  # 2. one step, its row in the history (and history.csv)
            if val_every and self.steps_done % val_every == 0:
                row = {**row, **self.evaluate()}  # 3. validation, merged into the step's row
            bar.set_postfix({self.progress_metric: f"{row.get(self.progress_metric, float('nan')):.3f}"})
            if every and folder and (self.steps_done % every == 0 or self.steps_done == self.config.steps):
                self.save(folder)  # 4. a checkpoint every N steps, and at the configured last step
            if on_step is not None:
                on_step(row)
        self._keep_samples()
        return self.history

    def _baseline(self) -> dict[str, float]:
        """The validation pass before training, as the history's row of step 0."""
        row = {"step": 0, **self.evaluate()}
        self._append_row(row, None)
        return row

    def _keep_samples(self) -> None:
        """Write the last step's samples into ``<output_dir>/samples/`` (if the run has a folder and a step)."""
        if self.output_dir is not None and self.steps_done:
            write_samples(self.output_dir, self.steps_done, self._samples())

    def _samples(self) -> pd.DataFrame:
        """The last step's samples, one row each (completions for RL, examples for DPO/KTO)."""
        return pd.DataFrame()

    def save_model(self, path: str | os.PathLike) -> Path:
        """The policy alone as a Hugging Face directory at ``path`` (safetensors, config, tokenizer; no optimizer):
        ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and vLLM load it as it is. Written under a
        hidden name and renamed into place, replacing an earlier one, so ``path`` is never half-written."""
        self._check_usable()
        path = Path(path).absolute()
        with checkpoints.written_in_place(path) as partial:
            self._policy.call(ActorRole.export, str(partial))
        return path

    # -- phases that complete or leave the trainer as it was (rlkit.trainer.safety) ---------------

    def _check_usable(self) -> None:
        """Refuse a phase of a trainer whose roles a newer trainer replaced, or that needs a resume."""
        self._owner.check(self.cluster)
        if self._needs_resume is not None:
            raise NeedsResume(f"{self.name} needs a resume: {self._needs_resume}, so it refuses to go on from "
                              f"part-way weights. {self._owner.hint}")

    @contextmanager
    def _changing_models(self, phase: str) -> Iterator[Change]:
        """Around a phase that changes the models: Stop waits for it to complete; if it ends early after some
        rank's weights moved, the trainer needs a resume (:meth:`_check_usable` refuses what follows). The block
        sets ``change.completed`` once the roles' calls returned (what fails after is bookkeeping)."""
        self._check_usable()
        before = self._steps_begun()
        change = Change()
        try:
            with interrupts_held(phase):
                yield change
        except BaseException as exc:
            if not change.completed:
                self._after_failure(phase, before, exc)
            raise

    def _after_failure(self, phase: str, before: list[int], exc: BaseException) -> None:
        try:
            moved = self._steps_begun() != before
        except BaseException:  # noqa: BLE001 - a dead or broken cluster cannot say: assume the worst
            moved = True
        if not moved:
            exc.add_note(f"rlkit: no weights changed: {self.name} is as it was before this {phase}.")
            return
        self._needs_resume = f"{phase} ended early ({type(exc).__name__}) after optimizer steps had begun"
        exc.add_note(f"rlkit: {self.name} now needs a resume: its weights moved part-way through the {phase}. "
                     f"{self._owner.hint}")

    def _steps_begun(self) -> list[int]:
        """Each rank's optimizer steps begun, per role: they change exactly when some weights move."""
        return self._policy.call(ActorRole.steps_begun)

    def _update_hint(self) -> None:
        """What a refusal tells the person to do: resume from this trainer's last checkpoint."""
        kind = type(self).__name__
        if self._checkpoint is not None:
            self._owner.hint = f"Continue from its last checkpoint: rlkit.{kind}.resume(cluster, '{self._checkpoint}')."
        else:
            self._owner.hint = (f"It saved no checkpoint: build a new one (rlkit.{kind}(cluster, config)), or resume "
                                f"one saved earlier with rlkit.{kind}.resume(cluster, path).")

    def _warn_past_schedule(self) -> None:
        """Before a step: warn (once) when it is the first past ``config.steps``, which the learning-rate schedule
        spans; such steps run at the schedule's last value."""
        if self.steps_done == self.config.steps:
            logger.warning(
                "step %d is past config.steps=%d, which the learning-rate schedule spans: it holds its last value",
                self.steps_done + 1,
                self.config.steps,
            )

    def _can_validate(self) -> bool:
        """Whether the run has validation data (trainers that have it say so)."""
        return False

    def evaluate(self) -> dict[str, float]:
        """A validation pass (trainers with validation prompts define it)."""
        raise NotImplementedError(f"{type(self).__name__} has no validation pass")

    def close(self) -> None:
        """Close the trackers (their files are complete); the trainer keeps working without them (a later step
        starts them again, continuing their runs)."""
        for tracker in self._trackers or []:
            tracker.close()
        self._trackers = None

    # -- rows and trackers -----------------------------------------------------------------------

    def _append_row(self, row: dict[str, float], samples: Callable[[], pd.DataFrame] | None) -> None:
        """Keep ``row`` in the history (and history.csv) and send it to the trackers, with ``samples()`` and into
        ``samples/`` at the first step and every SAMPLES_EVERY-th."""
        self._rows.append(row)
        if self._history_file is not None:
            self._history_file.update(self._rows)
        keep = samples is not None and (self.steps_done == 1 or self.steps_done % SAMPLES_EVERY == 0)
        table = samples() if samples is not None and keep else None
        if table is not None and self.output_dir is not None:
            write_samples(self.output_dir, self.steps_done, table)
        for tracker in self._started_trackers(int(row["step"])):
            tracker.log_metrics(self.steps_done, row)
            if table is not None:
                tracker.log_samples(self.steps_done, table)

    def _add_to_last_row(self, metrics: dict[str, float]) -> None:
        """Merge ``metrics`` (a validation pass) into the last step's row and send them to the trackers."""
        if self._rows:
            self._rows[-1].update(metrics)
            if self._history_file is not None:
                self._history_file.update(self._rows)
            for tracker in self._started_trackers(self.steps_done):
                tracker.log_metrics(self.steps_done, metrics)

    def _started_trackers(self, step: int) -> list[Tracker]:
        """The run's trackers, started at the first row they get (``step``: a resumed run's continue there)."""
        if self._trackers is None:
            names, folder = self.config.trackers, self.output_dir
            assert folder is not None or not names  # output_folder gives a folder to a run with trackers
            self._trackers = build_trackers(names, folder, self.config.to_dict(), first_step=step) if folder else []
        return self._trackers

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

    def adapters(self) -> pd.DataFrame:
        """Where each rank's LoRA adapters bound: one row per rank and adapted module name (e.g. "self_attn.q_proj"),
        with how many decoder layers have it, of how many (0 for a module outside the layers). Empty without
        LoRA. Ranks must agree (they bind the same model with the same targets)."""
        rows = []
        for rank, binding in enumerate(self._policy.call(ActorRole.adapter_binding)):
            if binding is None:
                continue
            layers = len(binding.per_layer)
            rows += [{"rank": rank, "module": name, "layers": count, "of_layers": layers}
                     for name, count in binding.summary().items()]
            rows += [{"rank": rank, "module": name, "layers": 0, "of_layers": layers}
                     for name in binding.outside_layers]
        return pd.DataFrame(rows, columns=["rank", "module", "layers", "of_layers"])

    def grad_norms(self) -> diagnostics.GradNorms:
        """The last optimizer step's per-rank, per-unit gradient norms, the true global norm, disagreements."""
        reports = self._policy.call(ActorRole.grad_report)
        if any(r is None for r in reports):
            raise RuntimeError("no update has run yet: call trainer.update(batch) or trainer.step() first")
        return diagnostics.grad_norms([r for r in reports if r is not None])

    def lint(self) -> diagnostics.Findings:
        """FSDP lint over every rank's actor, optimizer, reference and rollout engine."""
        return diagnostics.lint(self._policy.call(ActorRole.inspect))
