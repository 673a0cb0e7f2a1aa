"""Command line: ``rlkit train CONFIG`` (also ``python -m rlkit train CONFIG``; see rlkit.cli.train) and
``rlkit serve-tinker`` (rlkit.cli.serve_tinker)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rlkit.cli.serve_tinker import add_parser as add_serve_tinker
from rlkit.cli.serve_tinker import serve as serve_tinker
from rlkit.config import ENGINES
from rlkit.runtime import torchrun

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlkit", description="RL post-training of language models on FSDP workers.")
    sub = top.add_subparsers(dest="command", required=True)
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
    p.add_argument("--steps", type=int, help="override config.steps (the run's total)")
    p.add_argument("--rollout", choices=ENGINES, help="override config.rollout.engine")
    p.add_argument(
        "--output-dir",
        type=Path,
        help="the run's folder (overrides output_dir; default outputs/<algorithm>-<model>-<date>-<time> under the "
        "working directory)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="auto|PATH",
        help="continue a run up to its configured steps: auto = the latest complete checkpoint in the output folder "
        "(--output-dir or output_dir); PATH = a checkpoint",
    )
    p.add_argument("--report", type=Path, help="also copy the HTML report (always <output_dir>/report.html) here")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every worker line (vLLM's start-up and weight-loading messages) and rlkit's info log",
    )
    add_serve_tinker(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    from rlkit.cli.train import train

    args = parser().parse_args(argv)
    if args.command == "serve-tinker":
        return serve_tinker(args)
    if torchrun.launched() and torchrun.rank() > 0:
        return torchrun.serve()  # rank 0 is the controller (and worker rank 0); the others serve it
    if torchrun.launched():  # rank 0's worker sets up logging with its [rank 0] prefix
        return train(args)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    console.setLevel(logging.INFO if args.verbose else logging.WARNING)
    root, torch_logs = logging.getLogger(), logging.getLogger("torch")
    levels = root.level, torch_logs.level
    root.addHandler(console)
    root.setLevel(logging.INFO)
    if not args.verbose:  # torch's own notes on importing vLLM's kernels ("Triton not available") stay quiet
        torch_logs.setLevel(logging.ERROR)
    try:
        return train(args)
    finally:
        root.removeHandler(console)
        root.setLevel(levels[0])
        torch_logs.setLevel(levels[1])
