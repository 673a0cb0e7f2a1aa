"""Command line: ``rlkit train CONFIG`` prints one line per step and writes an HTML report.

``torchrun --nproc_per_node=G -m rlkit train CONFIG`` runs the same training with rank 0 as the
controller (rlkit.runtime.torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from functools import partial
from pathlib import Path

import pandas as pd

from rlkit import diagnostics
from rlkit.config import ENGINES, ConfigError, GRPOConfig, RLConfig, config_from_toml
from rlkit.data import load_run_data
from rlkit.diagnostics import visible_gpu_count, visible_gpu_memory_gib
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.runtime import Cluster, launch, torchrun
from rlkit.trainer.metrics import PHASES

HEADER = f"{'step':>4} {'reward':>7} {'kl':>8} {'len':>5} {'tok/s':>7} {'mem/rank MiB':>14}  phase seconds"


def format_step(row: dict) -> str:
    """One printed line: step, mean reward, KL, mean response length, tokens/s, memory per rank, phase times."""
    memory = "/".join(f"{row[k]:.0f}" for k in sorted(row) if k.startswith("memory/rank") and k.endswith("rss_mb"))
    cuda = [k for k in sorted(row) if k.startswith("memory/rank") and k.endswith("peak_mb")]
    if cuda:
        memory = "/".join(f"{row[k]:.0f}" for k in cuda)
    phases = " ".join(f"{p}={row[f'time/{p}']:.2f}" for p in PHASES)
    inner = " ".join(f"{k.split('/')[-1]}={row[k]:.2f}" for k in row if k.startswith("time/worker/"))
    val = f"  val reward {row['val/reward/mean']:.3f}" if "val/reward/mean" in row else ""
    return (
        f"{row['step']:>4} {row['reward/mean']:>7.3f} {row['kl/mean']:>8.4f} {row['response/length/mean']:>5.1f} "
        f"{row['perf/tokens_per_s']:>7.0f} {memory:>14}  {phases} (workers: {inner}){val}"
    )


def train(args: argparse.Namespace) -> int:
    """Check everything, run the training, print one line per step, write the history and the report.

    Under torchrun this runs on rank 0 only, whose process is also worker rank 0 (rlkit.runtime.torchrun).
    """
    from rlkit.report import write_report

    try:
        world_size = _world_size(args)
        config = config_from_toml(args.config) if args.config else GRPOConfig()
        if args.steps is not None:
            config = dataclasses.replace(config, steps=args.steps)
        if args.rollout is not None:
            config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=args.rollout))
        nodes = torchrun.node_of_ranks() if torchrun.launched() else None  # local: every rank on this machine
        gpus = visible_gpu_count() if args.device != "cpu" else None
        config.check_cluster(world_size, args.device, nodes=nodes, node_gpus=gpus)
        tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
        data = load_run_data(config, tokenizer)  # files, columns, templates, rewards: all checked before launch
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(data.summary(), flush=True)
    gpu_gib = visible_gpu_memory_gib() if args.device != "cpu" else None
    if gpu_gib is not None:  # GPUs: will it fit? (the estimate, before anything loads)
        findings = diagnostics.preflight(config, resolve_model_dir(config.model), world_size=world_size,
                                         device_memory_gib=gpu_gib)  # fmt: skip
        if findings.items:
            print(f"warning: {findings}", file=sys.stderr, flush=True)
    launcher = "torchrun" if torchrun.launched() else "local"
    print(
        f"rlkit: {config.algorithm.upper()} on model={config.model!r}, {world_size} worker(s) ({launcher}), "
        f"{config.steps} steps",
        flush=True,
    )
    start = time.perf_counter()
    if torchrun.launched():
        history, run_dir = torchrun.run_controller(partial(_fit, config, start), device=args.device)
    else:
        with launch(world_size=world_size, device=args.device) as cluster:
            history, run_dir = _fit(config, start, cluster)
    run_dir.mkdir(parents=True, exist_ok=True)
    history.to_csv(run_dir / "history.csv", index=False)
    first, last = history["reward/mean"].head(3).mean(), history["reward/mean"].tail(3).mean()
    print(
        f"mean reward: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; total {time.perf_counter() - start:.0f}s"
    )
    report = write_report(
        history, args.report, title=f"rlkit {config.algorithm.upper()}: {config.model}", config=config.to_dict()
    )
    print(f"report: {report.resolve()}; history: {(run_dir / 'history.csv').resolve()}")
    return 0


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


def _fit(config: RLConfig, start: float, cluster: Cluster) -> tuple[pd.DataFrame, Path]:
    """The training on ``cluster``, one printed line per step; returns the history and the run's folder."""
    from rlkit.trainer import Trainer

    trainer = Trainer(cluster, config)
    logs = cluster.log_dir if cluster.log_dir is not None else "torchrun's output"
    print(f"workers ready in {time.perf_counter() - start:.1f}s on {cluster.device}; logs in {logs}", flush=True)
    print(HEADER, flush=True)
    trainer.fit(progress=False, on_step=lambda row: print(format_step(row), flush=True))
    trainer.close()
    return trainer.history, trainer.run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run GRPO or PPO from a TOML config (default: GRPO on the bundled tiny task)")
    p.add_argument(
        "config",
        nargs="?",
        help='TOML file mirroring rlkit.GRPOConfig (algorithm = "ppo" at the top: rlkit.PPOConfig); '
        "omit for the defaults",
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
