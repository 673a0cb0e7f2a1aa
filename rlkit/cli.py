"""Command line: ``rlkit train CONFIG`` prints one line per step and writes an HTML report.

The TOML's ``algorithm`` picks the run: "grpo" (default) or "ppo" (rlkit.Trainer), "dpo" or "kto"
(rlkit.PreferenceTrainer); every problem of the config and its data is reported before launch.
``torchrun --nproc_per_node=G -m rlkit train CONFIG`` runs the same training with rank 0 as the
controller (rlkit.runtime.torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd

from rlkit import diagnostics
from rlkit.config import ENGINES, ConfigError, GRPOConfig, PreferenceConfig, RLConfig, config_from_toml
from rlkit.data import load_run_data
from rlkit.data.preferences import load_preferences
from rlkit.diagnostics import visible_gpu_count, visible_gpu_memory_gib
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, launch, torchrun
from rlkit.trainer import PreferenceTrainer, Trainer
from rlkit.trainer.base import PolicyTrainerBase
from rlkit.trainer.metrics import PHASES

HEADER = f"{'step':>4} {'reward':>7} {'kl':>8} {'len':>5} {'tok/s':>7} {'mem/rank MiB':>14}  phase seconds"
PREFERENCE_HEADER = f"{'step':>4} {'accuracy':>8} {'margins':>8} {'loss':>7} {'grad':>7} {'mem/rank MiB':>14}  seconds"


def _memory(row: dict) -> str:
    """Each rank's memory, "/"-joined: the CUDA peak on GPUs, else the process RSS."""
    memory = "/".join(f"{row[k]:.0f}" for k in sorted(row) if k.startswith("memory/rank") and k.endswith("rss_mb"))
    cuda = [k for k in sorted(row) if k.startswith("memory/rank") and k.endswith("peak_mb")]
    if cuda:
        memory = "/".join(f"{row[k]:.0f}" for k in cuda)
    return memory


def format_preference_step(row: dict) -> str:
    """One printed line of a DPO/KTO step: accuracy, margins, loss, grad norm, memory per rank, seconds."""
    inner = " ".join(f"{k.split('/')[-1]}={row[k]:.2f}" for k in row if k.startswith("time/worker/"))
    return (
        f"{row['step']:>4} {row['rewards/accuracy']:>8.3f} {row['rewards/margins']:>8.3f} {row['actor/loss']:>7.4f} "
        f"{row['actor/grad_norm']:>7.3f} {_memory(row):>14}  step={row['time/step']:.2f} (workers: {inner})"
    )


def format_step(row: dict) -> str:
    """One printed line: step, mean reward, KL, mean response length, tokens/s, memory per rank, phase times."""
    phases = " ".join(f"{p}={row[f'time/{p}']:.2f}" for p in PHASES)
    inner = " ".join(f"{k.split('/')[-1]}={row[k]:.2f}" for k in row if k.startswith("time/worker/"))
    val = f"  val reward {row['val/reward/mean']:.3f}" if "val/reward/mean" in row else ""
    return (
        f"{row['step']:>4} {row['reward/mean']:>7.3f} {row['kl/mean']:>8.4f} {row['response/length/mean']:>5.1f} "
        f"{row['perf/tokens_per_s']:>7.0f} {_memory(row):>14}  {phases} (workers: {inner}){val}"
    )


@dataclass
class Run:
    """A checked run: how to build its trainer on a cluster and how to print its steps."""

    config: RLConfig | PreferenceConfig
    summary: str
    """What the data checks found (printed before launch)."""
    trainer: Callable[[Cluster], PolicyTrainerBase]
    header: str
    format_step: Callable[[dict], str]
    metric: str
    """The history column summed up at the end, first 3 steps against the last 3."""
    label: str


def train(args: argparse.Namespace) -> int:
    """Check everything, run the training, print one line per step, write the history and the report.

    Under torchrun this runs on rank 0 only, whose process is also worker rank 0 (rlkit.runtime.torchrun).
    """
    try:
        world_size = _world_size(args)
        config = config_from_toml(args.config) if args.config else GRPOConfig()
        if args.steps is not None:
            config = dataclasses.replace(config, steps=args.steps)
        if isinstance(config, PreferenceConfig):
            run = _checked_preferences(args, config, world_size)
        else:
            run = _checked_rl(args, config, world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(run.summary, flush=True)
    launcher = "torchrun" if torchrun.launched() else "local"
    print(
        f"rlkit: {run.config.algorithm.upper()} on model={run.config.model!r}, {world_size} worker(s) ({launcher}), "
        f"{run.config.steps} steps",
        flush=True,
    )
    start = time.perf_counter()
    if torchrun.launched():
        history, run_dir = torchrun.run_controller(partial(_fit, run, start), device=args.device)
    else:
        with launch(world_size=world_size, device=args.device) as cluster:
            history, run_dir = _fit(run, start, cluster)
    return _finish(args, run, history, run_dir, start)


def _checked_rl(args: argparse.Namespace, config: RLConfig, world_size: int) -> Run:
    """GRPO/PPO: the config against the cluster, the data and rewards, then the memory estimate's warning on GPUs."""
    if args.rollout is not None:
        config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=args.rollout))
    nodes = torchrun.node_of_ranks() if torchrun.launched() else None  # local: every rank on this machine
    gpus = visible_gpu_count() if args.device != "cpu" else None
    config.check_cluster(world_size, args.device, nodes=nodes, node_gpus=gpus)
    tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
    data = load_run_data(config, tokenizer)  # files, columns, templates, rewards: all checked before launch
    gpu_gib = visible_gpu_memory_gib() if args.device != "cpu" else None
    if gpu_gib is not None:  # GPUs: will it fit? (the estimate, before anything loads)
        findings = diagnostics.preflight(config, resolve_model_dir(config.model), world_size=world_size,
                                         device_memory_gib=gpu_gib)  # fmt: skip
        if findings.items:
            print(f"warning: {findings}", file=sys.stderr, flush=True)
    return Run(config, data.summary(), partial(Trainer, config=config), HEADER, format_step, "reward/mean",
               "mean reward")  # fmt: skip


def _checked_preferences(args: argparse.Namespace, config: PreferenceConfig, world_size: int) -> Run:
    """DPO/KTO: the config against the cluster and the preference data (columns, values, lengths)."""
    if args.rollout is not None:
        name = config.algorithm.upper()
        raise ConfigError([f"--rollout {args.rollout}: {name} samples nothing (no rollout); leave it out"])
    config.check_cluster(world_size, args.device)
    tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
    _, summary = load_preferences(config, tokenizer)
    return Run(config, summary, partial(PreferenceTrainer, config=config), PREFERENCE_HEADER, format_preference_step,
               "rewards/accuracy", "preference accuracy")  # fmt: skip


def _world_size(args: argparse.Namespace) -> int:
    """--world-size (default 2), or under torchrun the processes it started."""
    if not torchrun.launched():
        return 2 if args.world_size is None else args.world_size
    if args.world_size not in (None, torchrun.world_size()):
        raise ConfigError(
            [
                f"--world-size={args.world_size} under torchrun, which started {torchrun.world_size()} processes "
                "(WORLD_SIZE): drop --world-size (torchrun's --nnodes and --nproc_per_node set it)"
            ]
        )
    return torchrun.world_size()


def _fit(run: Run, start: float, cluster: Cluster) -> tuple[pd.DataFrame, Path]:
    """The training on ``cluster``, one printed line per step; returns the history and the run's folder."""
    trainer = run.trainer(cluster)
    logs = cluster.log_dir if cluster.log_dir is not None else "torchrun's output"
    print(f"workers ready in {time.perf_counter() - start:.1f}s on {cluster.device}; logs in {logs}", flush=True)
    print(run.header, flush=True)
    trainer.fit(progress=False, on_step=lambda row: print(run.format_step(row), flush=True))
    trainer.close()
    return trainer.history, trainer.run_dir


def _finish(args: argparse.Namespace, run: Run, history: pd.DataFrame, run_dir: Path, start: float) -> int:
    """Write history.csv and the HTML report; print the run's metric over the first and last 3 steps."""
    from rlkit.report import write_report

    run_dir.mkdir(parents=True, exist_ok=True)
    history.to_csv(run_dir / "history.csv", index=False)
    first, last = history[run.metric].head(3).mean(), history[run.metric].tail(3).mean()
    total = time.perf_counter() - start
    print(f"{run.label}: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; total {total:.0f}s")
    config = run.config
    report = write_report(
        history, args.report, title=f"rlkit {config.algorithm.upper()}: {config.model}", config=config.to_dict()
    )
    print(f"report: {report.resolve()}; history: {(run_dir / 'history.csv').resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train", help="run GRPO, PPO, DPO or KTO from a TOML config (default: GRPO on the bundled tiny task)"
    )
    p.add_argument(
        "config",
        nargs="?",
        help='TOML file mirroring rlkit.GRPOConfig (algorithm = "ppo", "dpo" or "kto" at the top: rlkit.PPOConfig, '
        "rlkit.DPOConfig, rlkit.KTOConfig); omit for the defaults",
    )
    p.add_argument("--world-size", type=int, help="worker processes (default 2; under torchrun: its WORLD_SIZE)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, help="override config.steps")
    p.add_argument("--rollout", choices=ENGINES, help="override config.rollout.engine")
    p.add_argument("--report", type=Path, default=Path("reports/report.html"), help="HTML report path")
    args = parser.parse_args(argv)
    if torchrun.launched() and torchrun.rank() > 0:
        return torchrun.serve()  # rank 0 is the controller (and worker rank 0); the others serve it
    if not torchrun.launched():  # under torchrun, rank 0's worker sets up logging with its [rank 0] prefix
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return train(args)
