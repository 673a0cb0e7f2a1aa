"""Where a demo step's time goes: share per phase and controller overhead (figures, not a test).

    python bench/phase_shares.py [--steps 8] [--world-size 2] [--config configs/grpo_tiny.toml]

Worker phases are the slowest rank's seconds inside the call (generate,
logprobs, reference, update, sync, and with PPO the critic's values and
update); score and advantages run on the
controller; overhead is everything else in the step: sending and receiving
batches, (de)tokenising, assembling, waiting on the channel.
"""

from __future__ import annotations

import argparse
import time

import rlkit
from rlkit.config import config_from_toml

WORKER = ("generate", "logprobs", "reference", "critic_values", "critic_update", "update", "sync")
CONTROLLER = ("score", "advantages")


def shares(history) -> dict[str, float]:
    """Mean seconds per step of each part, overhead included (skipping the first, warm-up step)."""
    h = history.iloc[1:] if len(history) > 1 else history
    parts = {p: h.get(f"time/worker/{p}", 0.0 * h["time/step"]).mean() for p in WORKER}
    parts.update({p: h[f"time/{p}"].mean() for p in CONTROLLER})
    parts["controller overhead"] = h["time/step"].mean() - sum(parts.values())
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_tiny.toml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    config = config_from_toml(args.config)
    start = time.perf_counter()
    with rlkit.launch(world_size=args.world_size) as cluster:
        launched = time.perf_counter() - start
        trainer = rlkit.Trainer(cluster, config)
        history = trainer.fit(args.steps, progress=False)
    parts = shares(history)
    step = history["time/step"].iloc[1:].mean()
    print(
        f"launch {launched:.1f}s; {args.steps} steps on {args.world_size} ranks; "
        f"mean step {step:.3f}s (first step excluded)"
    )
    print(f"{'part':<22}{'seconds':>9}{'share':>8}")
    for name, seconds in parts.items():
        print(f"{name:<22}{seconds:>9.3f}{seconds / step:>8.1%}")


if __name__ == "__main__":
    main()
