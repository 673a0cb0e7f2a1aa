"""Soak: many tiny-model GRPO steps on CPU, watching memory so that a slow leak shows (figures, not a test).

    nice python bench/soak.py [--steps 1000] [--every 100] [--warmup 100] [--world-size 2]

Every ``--every`` steps it prints the controller's RSS, file descriptors and threads, each worker's RSS
(``cluster.status()``, from the workers' heartbeats), each process's anonymous resident memory (Linux's
RssAnon: the heap, without the mapped library files that the kernel drops and reloads under memory
pressure, which move RSS on a shared machine) and the mean seconds per step since the last line. At the
end: each process's drift from the end of the warm-up (``--warmup`` steps) to the last step.
"""

from __future__ import annotations

import argparse
import os
import time

import psutil

import rlkit


def anon_mb(pid: int) -> float:
    """RssAnon of process ``pid`` in MiB (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("RssAnon:"))
    return int(kib) / 1024


def sample(cluster: rlkit.runtime.Cluster) -> dict[str, float]:
    """RSS and anonymous RSS in MiB of the controller and of each rank, the controller's fds and threads."""
    me = psutil.Process()
    status = cluster.status()
    row = {"controller": me.memory_info().rss / 2**20, "controller anon": anon_mb(me.pid),
           "fds": me.num_fds(), "threads": me.num_threads()}
    for rank, pid, rss in zip(status["rank"], status["pid"], status["rss_mb"], strict=True):
        row.update({f"rank{rank}": rss, f"rank{rank} anon": anon_mb(int(pid))})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    config = rlkit.GRPOConfig(model="tiny", seed=0, steps=args.steps)
    with rlkit.launch(world_size=args.world_size, device="cpu") as cluster:
        trainer = rlkit.Trainer(cluster, config)
        samples: dict[int, dict[str, float]] = {}
        names = ["controller"] + [f"rank{r}" for r in range(args.world_size)]
        print(f"tiny model, {args.world_size} ranks on CPU, {config.prompts_per_step} prompts x "
              f"{config.group_size} samples, up to {config.rollout.max_new_tokens} new tokens; pid {os.getpid()}")
        print(f"{'step':>6}" + "".join(f"{n + ' MiB':>16}{'anon':>8}" for n in names)
              + f"{'fds':>6}{'threads':>9}{'s/step':>9}{'reward':>9}")
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            row = trainer.step()
            if step % args.every == 0:
                per_step = (time.perf_counter() - start) / args.every
                samples[step] = s = sample(cluster)
                print(f"{step:>6}" + "".join(f"{s[n]:>16.1f}{s[n + ' anon']:>8.1f}" for n in names)
                      + f"{s['fds']:>6}{s['threads']:>9}{per_step:>9.3f}{row['reward/mean']:>9.3f}", flush=True)
                start = time.perf_counter()
    first = min(s for s in samples if s >= args.warmup)
    base, last = samples[first], samples[max(samples)]
    for kind in ("", " anon"):
        drift = ", ".join(f"{n} {100 * (last[n + kind] / base[n + kind] - 1):+.1f}%" for n in names)
        print(f"{'RSS' if not kind else 'anonymous RSS'} drift from step {first} to step {max(samples)}: {drift}")


if __name__ == "__main__":
    main()
