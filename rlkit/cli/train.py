"""``rlkit train CONFIG``: check everything, train with one printed line per step, keep everything in the run's folder.

The TOML's ``algorithm`` picks the run: "grpo" (default) or "ppo" (rlkit.Trainer), "dpo" or "kto"
(rlkit.PreferenceTrainer). Every problem of the arguments, the config and its data is reported before launch.
The run's folder (rlkit.cli.folder) gets history.csv after every step, checkpoints, the report with sample
completions and the final model; a failed step keeps what was done and prints the command that resumes.
``torchrun --nproc_per_node=G -m rlkit train CONFIG`` runs the same training with rank 0 as the controller.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit import diagnostics
from rlkit.cli.folder import WORKER_LOGS, RunFolder, log_to_file, prepare
from rlkit.cli.lines import StepLines, loss_phrase, preference_lines, progress, rl_lines
from rlkit.cli.outcome import Outcome, failure_message
from rlkit.config import ConfigError, GRPOConfig, PreferenceConfig, RLConfig, config_from_toml
from rlkit.data import load_run_data
from rlkit.data.preferences import load_preferences
from rlkit.diagnostics import visible_gpu_count, visible_gpu_memory_gib
from rlkit.models import describe_lora, load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, launch, torchrun
from rlkit.trainer import PreferenceTrainer, Trainer, checkpoints
from rlkit.trainer.agentic import ENVIRONMENT_TERM
from rlkit.trainer.base import PolicyTrainerBase
from rlkit.trainer.outputs import read_samples

FINAL = "final"
REPORT = "report.html"


@dataclass
class Run:
    """A checked run: how to build (or resume) its trainer on a cluster and how to print its steps."""

    config: RLConfig | PreferenceConfig
    summary: str
    """What the data checks found (printed before launch)."""
    trainer: Callable[[Cluster], PolicyTrainerBase]
    resume: Callable[[Cluster, Path], PolicyTrainerBase]
    lines: StepLines
    metric: str
    """The history column summed up at the end."""
    label: str


def train(args: argparse.Namespace) -> int:
    """Check everything, run the training, print one line per step, keep everything in the run's folder.

    Under torchrun this runs on rank 0 only, whose process is also worker rank 0 (rlkit.runtime.torchrun).
    """
    try:
        world_size, config = _arguments(args)
        folder = prepare(config, args.resume)
        config = dataclasses.replace(config, output_dir=str(folder.path))
        with _together() as problems:
            if folder.checkpoint is not None:
                problems += checkpoints.resume_problems(folder.checkpoint, config)
            with _together(problems):
                run = _checked(args, config, world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    handler = log_to_file(folder.path)
    try:
        _print_start(args, run, folder, world_size)
        start = time.perf_counter()
        if torchrun.launched():
            outcome = torchrun.run_controller(partial(_train_on, run, folder), device=args.device)
        else:
            logs = folder.path / WORKER_LOGS
            with launch(world_size=world_size, device=args.device, log_dir=logs, verbose=args.verbose) as cluster:
                outcome = _train_on(run, folder, cluster)
        return _finish(args, run, folder, outcome, time.perf_counter() - start)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def _arguments(args: argparse.Namespace) -> tuple[int, RLConfig | PreferenceConfig]:
    """The world size (checked first) and the config with the command line's overrides; every problem at once."""
    problems: list[str] = []
    world_size = 0
    try:
        world_size = _world_size(args)
        _warn_cores(args, world_size)
    except ConfigError as exc:
        problems += exc.problems
    config: RLConfig | PreferenceConfig | None = None
    try:
        config = config_from_toml(args.config) if args.config else GRPOConfig()
    except ConfigError as exc:
        problems += exc.problems
    except FileNotFoundError:
        problems.append(f"{args.config}: no such file; give the path of a TOML config")
    if problems or config is None:
        raise ConfigError(problems)
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.output_dir is not None:
        overrides["output_dir"] = str(args.output_dir)
    if args.rollout is not None and isinstance(config, RLConfig):
        overrides["rollout"] = dataclasses.replace(config.rollout, engine=args.rollout)
    return world_size, dataclasses.replace(config, **overrides) if overrides else config


def _world_size(args: argparse.Namespace) -> int:
    """--world-size (default 2), or under torchrun the processes it started."""
    if not torchrun.launched():
        size = 2 if args.world_size is None else args.world_size
        if size < 1:
            raise ConfigError([f"--world-size {size}: the number of worker processes must be >= 1, e.g. 2"])
        return size
    if args.world_size not in (None, torchrun.world_size()):
        raise ConfigError(
            [
                f"--world-size={args.world_size} under torchrun, which started {torchrun.world_size()} processes "
                "(WORLD_SIZE): drop --world-size (torchrun's --nnodes and --nproc_per_node set it)"
            ]
        )
    return torchrun.world_size()


def _warn_cores(args: argparse.Namespace, world_size: int) -> None:
    """More CPU worker processes than cores: each gets a share of a core (a warning; the run still works)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    on_cpu = args.device == "cpu" or (args.device == "auto" and not visible_gpu_count())
    if on_cpu and world_size > cores and not torchrun.launched():
        print(f"warning: {world_size} worker processes on {cores} CPU core(s): each gets less than a core and "
              f"the run is slower than with --world-size {cores}", file=sys.stderr, flush=True)  # fmt: skip


def _checked(args: argparse.Namespace, config: RLConfig | PreferenceConfig, world_size: int) -> Run:
    if isinstance(config, PreferenceConfig):
        return _checked_preferences(args, config, world_size)
    return _checked_rl(args, config, world_size)


def _checked_rl(args: argparse.Namespace, config: RLConfig, world_size: int) -> Run:
    """GRPO/PPO: the config against the cluster, the data and rewards (all problems together), then the memory
    estimate's warning on GPUs."""
    nodes = torchrun.node_of_ranks() if torchrun.launched() else None  # local: every rank on this machine
    gpus = visible_gpu_count() if args.device != "cpu" else None
    tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
    with _together() as problems:
        with _together(problems):
            diagnostics.check_launch(config, world_size, args.device, nodes=nodes, node_gpus=gpus)
        data = load_run_data(config, tokenizer, base_dir=_base_dir(args))  # every file and reward, before launch
    gpu_gib = visible_gpu_memory_gib() if args.device != "cpu" else None
    plan_line = ""
    if gpu_gib is not None:  # GPUs: will it fit? (the plan, before anything loads: ConfigError if nothing fits)
        _, host_gib = diagnostics.host_memory()  # this machine's, for the ranks it launches (torchrun: its node's)
        per_host = max(Counter(nodes).values()) if nodes else world_size
        plan = diagnostics.plan_run(config, resolve_model_dir(config.model), world_size=world_size, device="cuda",
                                    device_memory_gib=gpu_gib, host_memory_gib=host_gib,
                                    ranks_per_host=per_host)  # fmt: skip
        plan_line = plan.line  # a plan fits with room: no preflight finding is left to warn of
    terms = [t.name for t in data.rewards] + (["reward_model"] if config.reward_model.path else [])
    terms += [ENVIRONMENT_TERM] if data.agent is not None and data.agent.environment is not None else []
    summary = "\n".join(line for line in (data.summary(), describe_lora(config), plan_line) if line)
    lines = rl_lines(terms, agent=data.agent is not None, mismatch=_gap_shown(config),
                     correction=config.rollout_correction.enabled)  # fmt: skip
    return Run(config, summary, partial(Trainer, config=config), partial(_resume, Trainer, config), lines,
               "reward/mean", "mean reward")


def _gap_shown(config: RLConfig) -> bool:
    """The step line's gap column: with a correction, or a vLLM engine returning log-probs (the hf engine runs the
    trainer's own model class in its process: its gap is rarely news, and the line stays under 100 characters)."""
    engine_logprobs = config.rollout.engine == "vllm" and config.rollout.engine_logprobs > 0
    return config.rollout_correction.enabled or engine_logprobs


def _checked_preferences(args: argparse.Namespace, config: PreferenceConfig, world_size: int) -> Run:
    """DPO/KTO: the config against the cluster and the preference data (columns, values, lengths)."""
    if args.rollout is not None:
        name = config.algorithm.upper()
        raise ConfigError([f"--rollout {args.rollout}: {name} samples nothing (no rollout); leave it out"])
    tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
    summaries = []
    with _together() as problems:
        with _together(problems):
            diagnostics.check_launch(config, world_size, args.device)
        for split in ("train", "val") if config.data.val_files else ("train",):
            with _together(problems):
                summaries.append(load_preferences(config, tokenizer, base_dir=_base_dir(args), split=split)[1])
    summary = "\n".join(summaries)
    return Run(config, summary, partial(PreferenceTrainer, config=config),
               partial(_resume, PreferenceTrainer, config), preference_lines(), "rewards/accuracy",
               "preference accuracy")  # fmt: skip


@contextlib.contextmanager
def _together(problems: list[str] | None = None) -> Iterator[list[str]]:
    """Collect the problems of the ConfigErrors raised in the block into ``problems``; the outermost block (no
    list given) raises them all at its end, as one ConfigError."""
    outer = problems is None
    found: list[str] = [] if problems is None else problems
    try:
        yield found
    except ConfigError as exc:
        found += [p for p in exc.problems if p not in found]
    if outer and found:
        raise ConfigError(found)


def _resume(kind: type, config: object, cluster: Cluster, checkpoint: Path) -> PolicyTrainerBase:
    trainer: PolicyTrainerBase = kind.resume(cluster, checkpoint, config=config)  # type: ignore[attr-defined]
    return trainer


def _base_dir(args: argparse.Namespace) -> Path | None:
    """The TOML file's folder: relative data and reward files are looked for there first."""
    return Path(args.config).resolve().parent if args.config else None


def _print_start(args: argparse.Namespace, run: Run, folder: RunFolder, world_size: int) -> None:
    """What runs where, the data, where everything goes: a few lines before launch."""
    config = run.config
    launcher = "torchrun" if torchrun.launched() else "local"
    print(
        f"rlkit train: {config.algorithm.upper()} on model={config.model!r}, {world_size} worker(s) ({launcher}), "
        f"{config.steps} steps{loss_phrase(config)}; output in {folder.path}",
        flush=True,
    )
    if folder.checkpoint is not None:
        done = checkpoints.read_meta(folder.checkpoint)["steps_done"]
        print(f"resuming from {folder.checkpoint} (step {done} of {config.steps})", flush=True)
        _print_changes(folder.checkpoint, config)
    print(run.summary, flush=True)


def _print_changes(checkpoint: Path, config: RLConfig | PreferenceConfig) -> None:
    """The settings this resume changes from the checkpoint's run (a longer run: steps)."""
    from rlkit.tracking import flatten_config

    before = flatten_config(checkpoints.read_meta(checkpoint)["config"])
    now = flatten_config(config.to_dict())
    changed = [f"{k} {before.get(k)} -> {v}" for k, v in now.items() if before.get(k) != v and k != "output_dir"]
    if changed:
        print("settings changed since the checkpoint: " + "; ".join(changed), flush=True)


def _train_on(run: Run, folder: RunFolder, cluster: Cluster) -> Outcome:
    """The training on ``cluster``, one printed line per step, then the final model; a failure is kept in the
    outcome (with what was saved), not raised."""
    outcome = Outcome()
    trainer: PolicyTrainerBase | None = None
    try:
        trainer = run.trainer(cluster) if folder.checkpoint is None else run.resume(cluster, folder.checkpoint)
        outcome.trainer = trainer
        print(run.lines.header(), flush=True)
        trainer.fit(progress=False, on_step=lambda row: print(run.lines.line(row), flush=True))
        if run.config.checkpoint.save_final:
            outcome.final = trainer.save_model(folder.path / FINAL)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - kept in the outcome, reported by _finish
        outcome.failed(exc, trainer, cluster, resuming=folder.checkpoint)
    finally:
        if trainer is not None:
            trainer.close()
    return outcome


def _finish(args: argparse.Namespace, run: Run, folder: RunFolder, outcome: Outcome, seconds: float) -> int:
    """The report (with the first and last steps' samples) and the end summary; a failed run's message."""
    history = outcome.history()
    if not history.empty:
        report = _write_report(run, folder.path, history)
        if args.report is not None:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(report, args.report)
    if outcome.error is not None:
        print(failure_message(args, folder.path, outcome), file=sys.stderr, flush=True)
        return 1
    steps = int(history["step"].max()) if not history.empty else 0
    print(f"done: {steps} step{'s' * (steps != 1)}, {seconds:.0f}s; {progress(history, run.metric, run.label)}",
          flush=True)  # fmt: skip
    kept = [name for name in ("history.csv", REPORT, "checkpoints", FINAL) if (folder.path / name).exists()]
    print(f"output: {folder.path} ({', '.join(kept)})", flush=True)
    return 0


def _write_report(run: Run, folder: Path, history: pd.DataFrame) -> Path:
    from rlkit.report import write_report

    samples = read_samples(folder)
    shown = {step: samples[step] for step in sorted(samples)[:1] + sorted(samples)[-1:]}
    config = run.config
    return write_report(history, folder / REPORT, title=f"rlkit {config.algorithm.upper()}: {config.model}",
                        config=config.to_dict(), samples=shown)  # fmt: skip
