"""How a run of ``rlkit train`` ended, and the few lines a failed one prints: what failed at which step, what
was kept, the fix, the command that resumes, and where the full traceback is."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlkit.cli.folder import LOG, WORKER_LOGS, resume_command, write_traceback
from rlkit.data.rewards import RewardError
from rlkit.runtime import Cluster, torchrun
from rlkit.runtime.errors import RemoteError, WorkerDied, WorkerHung, WorkerOutOfMemory
from rlkit.trainer import checkpoints
from rlkit.trainer.base import PolicyTrainerBase
from rlkit.trainer.outputs import HISTORY, checkpoint_folder

logger = logging.getLogger(__name__)

HEADLINE_CHARS = 400
"""The failure's first line is cut to this length (the whole of it is in rlkit.log)."""


@dataclass
class Outcome:
    """The trainer a run built, the final model it wrote, or the failure that ended it and what was kept."""

    trainer: PolicyTrainerBase | None = None
    final: Path | None = None
    error: BaseException | None = None
    step: int = 0
    """The step that failed (0: before the first step began)."""
    saved: Path | None = None
    """The checkpoint written at the failure (the last completed step, when the models were left intact)."""
    kept: Path | None = None
    """The latest complete checkpoint after the failure, the one ``--resume auto`` continues from."""

    def history(self) -> pd.DataFrame:
        return self.trainer.history if self.trainer is not None else pd.DataFrame()

    def failed(
        self, exc: BaseException, trainer: PolicyTrainerBase | None, cluster: Cluster, resuming: Path | None = None
    ) -> None:
        """Keep ``exc``; if a reward function failed (no model changed) save the last completed step, so that a
        resume loses nothing (a failure inside the workers may have left the models half-updated: not saved).
        ``resuming``: the checkpoint the run was resuming from, still there when the trainer failed to start."""
        self.error = exc
        if trainer is None:
            self.kept = resuming
            return
        self.step = trainer.steps_done + 1
        folder = checkpoint_folder(trainer.config, trainer.output_dir)
        if folder is None:
            return
        if isinstance(exc, RewardError) and trainer.steps_done > 0 and not cluster.closed:
            try:
                self.saved = trainer.save(folder)
            except Exception:  # noqa: BLE001 - the run's failure is what gets reported; this goes to the log
                logger.exception("could not save a checkpoint of step %d after the failure", trainer.steps_done)
        found = checkpoints.complete(folder)
        self.kept = found[-1] if found else None


def failure_message(args: argparse.Namespace, folder: Path, outcome: Outcome) -> str:
    """A few lines: the failure, what was kept, the fix and the command that resumes; the traceback goes to the log."""
    exc = outcome.error
    assert exc is not None
    log = write_traceback(folder, exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    named = isinstance(exc, RewardError | RemoteError | WorkerDied | WorkerHung)  # their first line says it all
    headline = first if named else f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if len(headline) > HEADLINE_CHARS:
        headline = headline[:HEADLINE_CHARS] + " ..."
    where = f"step {outcome.step}" if outcome.step else "the start"
    lines = [f"error at {where}: {headline}"]
    steps = len(outcome.history())
    kept = [f"{HISTORY} ({steps} step{'s' * (steps != 1)})"] if steps else []
    if outcome.kept is not None:
        kept.append(f"checkpoint {outcome.kept.name}" + (" (written now)" if outcome.saved else ""))
    if kept:
        lines.append(f"kept in {folder}: {', '.join(kept)}")
    lines.append(f"fix: {_fix(exc, folder)}")
    if outcome.kept is not None:
        lines.append(f"then resume with: {resume_command(args, folder, torchrun.launched())}")
    else:
        lines.append("nothing to resume from (no checkpoint: [checkpoint] every = N keeps them); run it again")
    lines.append(f"full traceback: {log}")
    return "\n".join(lines)


def _fix(exc: BaseException, folder: Path) -> str:
    """What to do about ``exc``, in a few words."""
    if isinstance(exc, RewardError):
        return "the reward function (the models are as they were after the last completed step)"
    if isinstance(exc, KeyboardInterrupt):
        return "nothing to fix (interrupted)"
    if isinstance(exc, WorkerOutOfMemory):
        return "a rank ran out of memory: lower micro_batch_size, or set max_tokens_per_micro_batch (each rank's " \
            f"memory is in {LOG})"
    if isinstance(exc, WorkerDied):
        return f"a worker process died: its output is in {folder / WORKER_LOGS}"
    if isinstance(exc, WorkerHung):
        return f"ranks hung: their Python stacks are in {LOG}"
    if isinstance(exc, RemoteError):
        return f"a worker raised: the remote traceback is in {LOG}"
    return f"see the traceback in {LOG}"
