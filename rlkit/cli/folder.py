"""The run's folder as ``rlkit train`` uses it: where it is, what a resume continues from, its log file, and the
message a failed run leaves (what was kept, the fix, the command that resumes).

Layout of ``<output_dir>``: ``config.toml`` (the config as run), ``history.csv`` (rewritten after every step),
``samples/``, ``report.html``, ``checkpoints/step-<N>/``, ``final/`` (a Hugging Face directory), ``rlkit.log``
(this process's log, with the full traceback of a failure), ``logs/rank<N>.log`` (each worker's output) and the
trackers' folders (``tensorboard/``, ``wandb/``, ``mlruns/``).
"""

from __future__ import annotations

import logging
import shlex
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.config import ConfigError, default_output_dir
from rlkit.trainer import checkpoints
from rlkit.trainer.outputs import HISTORY, checkpoint_folder

LOG = "rlkit.log"
WORKER_LOGS = "logs"


@dataclass(frozen=True)
class RunFolder:
    """Where a run writes, and the checkpoint it continues from (None: a fresh run)."""

    path: Path
    checkpoint: Path | None


def prepare(config: Any, resume: str | None) -> RunFolder:
    """The folder of ``config`` (its ``output_dir``, else a new default one) and, with ``resume`` ("auto" or a
    checkpoint's path), the checkpoint to continue from. Raises ConfigError naming the folder and the fix."""
    named = bool(config.output_dir)
    if resume is None:
        path = Path(config.output_dir).absolute() if named else default_output_dir(config.algorithm, config.model)
        if (path / HISTORY).exists():
            raise ConfigError([
                f"output_dir {path} already holds a run ({HISTORY}): continue it with --resume auto, or give another "
                "--output-dir (or delete the folder)"
            ])  # fmt: skip
        return RunFolder(path, None)
    if resume != "auto":
        return _from_checkpoint(config, Path(resume))
    if not named:
        raise ConfigError([
            "--resume auto continues the run in output_dir, which this config leaves to a new folder per run: give "
            "--output-dir <the run's folder> (printed when it started) or set output_dir in the TOML"
        ])  # fmt: skip
    path = Path(config.output_dir).absolute()
    root = checkpoint_folder(config, path)
    found = checkpoints.complete(root) if root is not None else []
    if not found:
        raise ConfigError([
            f"--resume auto: no complete checkpoint in {root} (a run keeps them with [checkpoint] every = N); "
            "start again without --resume, or give --resume PATH to a checkpoint"
        ])  # fmt: skip
    return RunFolder(path, found[-1])


def _from_checkpoint(config: Any, given: Path) -> RunFolder:
    """``--resume PATH``: a checkpoint (or a folder of them); the run's folder is output_dir if set, else the one
    the checkpoint's run wrote into."""
    try:
        checkpoint = checkpoints.resolve(given)
    except FileNotFoundError as exc:
        raise ConfigError([f"--resume {given}: {exc}"]) from None
    recorded = checkpoints.read_meta(checkpoint)["config"].get("output_dir") or ""
    folder = config.output_dir or recorded or str(default_output_dir(config.algorithm, config.model))
    return RunFolder(Path(folder).absolute(), checkpoint)


def log_to_file(folder: Path) -> logging.Handler:
    """Send rlkit's log records (INFO and up) and every other library's warnings to ``<folder>/rlkit.log`` as
    well; returns the handler."""
    folder.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(folder / LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    handler.addFilter(lambda record: record.name.startswith("rlkit") or record.levelno >= logging.WARNING)
    logging.getLogger().addHandler(handler)
    return handler


def write_traceback(folder: Path, exc: BaseException) -> Path:
    """Append ``exc``'s full traceback (chained causes and notes included) to ``<folder>/rlkit.log``."""
    path = folder / LOG
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(traceback.format_exception(exc)))
    return path


def resume_command(args: Any, folder: Path, under_torchrun: bool) -> str:
    """The command that continues this run: the same arguments, with ``--resume auto --output-dir <folder>``."""
    words = ["train", *([args.config] if args.config else [])]
    for flag, value in (("--world-size", args.world_size), ("--device", args.device if args.device != "auto" else None),
                        ("--steps", args.steps), ("--rollout", args.rollout), ("--report", args.report)):  # fmt: skip
        words += [flag, str(value)] if value is not None else []
    words += ["--verbose"] if args.verbose else []
    command = shlex.join([*words, "--resume", "auto", "--output-dir", str(folder)])
    return f"torchrun <your torchrun options> -m rlkit {command}" if under_torchrun else f"rlkit {command}"
