"""Command line: ``rlkit train CONFIG`` prints one line per step and writes an HTML report.

The TOML's ``algorithm`` picks the run: "grpo" (default) or "ppo" (rlkit.Trainer), "dpo" or "kto"
(rlkit.PreferenceTrainer); every problem of the config and its data is reported before launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from rlkit import diagnostics
from rlkit.config import ENGINES, ConfigError, GRPOConfig, PreferenceConfig, RLConfig, config_from_toml
from rlkit.data import load_run_data
from rlkit.data.preferences import load_preferences
from rlkit.diagnostics import visible_gpu_memory_gib
from rlkit.models import load_tokenizer, resolve_model_dir
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
    memory = _memory(row)
    phases = " ".join(f"{p}={row[f'time/{p}']:.2f}" for p in PHASES)
    inner = " ".join(f"{k.split('/')[-1]}={row[k]:.2f}" for k in row if k.startswith("time/worker/"))
    val = f"  val reward {row['val/reward/mean']:.3f}" if "val/reward/mean" in row else ""
    return (
        f"{row['step']:>4} {row['reward/mean']:>7.3f} {row['kl/mean']:>8.4f} {row['response/length/mean']:>5.1f} "
        f"{row['perf/tokens_per_s']:>7.0f} {memory:>14}  {phases} (workers: {inner}){val}"
    )


def train(args: argparse.Namespace) -> int:
    try:
        config = config_from_toml(args.config) if args.config else GRPOConfig()
        if args.steps is not None:
            config = dataclasses.replace(config, steps=args.steps)
        if args.rollout is not None:
            if isinstance(config, PreferenceConfig):
                name = config.algorithm.upper()
                raise ConfigError([f"--rollout {args.rollout}: {name} samples nothing (no rollout); leave it out"])
            config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=args.rollout))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(config, PreferenceConfig):
        return train_preferences(args, config)
    return train_rl(args, config)


def train_rl(args: argparse.Namespace, config: RLConfig) -> int:
    import rlkit

    try:
        config.check_cluster(args.world_size, args.device)
        tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
        data = load_run_data(config, tokenizer)  # files, columns, templates, rewards: all checked before launch
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(data.summary(), flush=True)
    gpu_gib = visible_gpu_memory_gib() if args.device != "cpu" else None
    if gpu_gib is not None:  # GPUs: will it fit? (the estimate, before anything loads)
        findings = diagnostics.preflight(config, resolve_model_dir(config.model), world_size=args.world_size,
                                         device_memory_gib=gpu_gib)  # fmt: skip
        if findings.items:
            print(f"warning: {findings}", file=sys.stderr, flush=True)
    start = _announce(args, config)
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        trainer = rlkit.Trainer(cluster, config)
        print(
            f"workers ready in {time.perf_counter() - start:.1f}s on {cluster.device}; logs in {cluster.log_dir}",
            flush=True,
        )
        print(HEADER, flush=True)
        trainer.fit(progress=False, on_step=lambda row: print(format_step(row), flush=True))
        trainer.close()
    return _finish(args, trainer, "reward/mean", "mean reward", start)


def train_preferences(args: argparse.Namespace, config: PreferenceConfig) -> int:
    """``rlkit train`` of a DPO or KTO config: the data checked before launch, then one line per step."""
    import rlkit

    try:
        config.check_cluster(args.world_size, args.device)
        tokenizer = load_tokenizer(resolve_model_dir(config.model), trust_remote_code=config.trust_remote_code)
        _, summary = load_preferences(config, tokenizer)  # columns, values, lengths: all checked before launch
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary, flush=True)
    start = _announce(args, config)
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        trainer = rlkit.PreferenceTrainer(cluster, config)
        print(
            f"workers ready in {time.perf_counter() - start:.1f}s on {cluster.device}; logs in {cluster.log_dir}",
            flush=True,
        )
        print(PREFERENCE_HEADER, flush=True)
        trainer.fit(progress=False, on_step=lambda row: print(format_preference_step(row), flush=True))
        trainer.close()
    return _finish(args, trainer, "rewards/accuracy", "preference accuracy", start)


def _announce(args: argparse.Namespace, config: RLConfig | PreferenceConfig) -> float:
    """Print what runs; returns the start time."""
    print(
        f"rlkit: {config.algorithm.upper()} on model={config.model!r}, {args.world_size} worker(s), "
        f"{config.steps} steps",
        flush=True,
    )
    return time.perf_counter()


def _finish(args: argparse.Namespace, trainer: PolicyTrainerBase, metric: str, label: str, start: float) -> int:
    """Write history.csv and the HTML report; print ``metric`` over the first and last 3 steps."""
    from rlkit.report import write_report

    history = trainer.history
    trainer.run_dir.mkdir(parents=True, exist_ok=True)
    history.to_csv(trainer.run_dir / "history.csv", index=False)
    first, last = history[metric].head(3).mean(), history[metric].tail(3).mean()
    print(f"{label}: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; total {time.perf_counter() - start:.0f}s")
    config = trainer.config
    report = write_report(
        history, args.report, title=f"rlkit {config.algorithm.upper()}: {config.model}", config=config.to_dict()
    )
    print(f"report: {report.resolve()}; history: {(trainer.run_dir / 'history.csv').resolve()}")
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
    p.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, help="override config.steps")
    p.add_argument("--rollout", choices=ENGINES, help="override config.rollout.engine")
    p.add_argument("--report", type=Path, default=Path("reports/report.html"), help="HTML report path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return train(args)
