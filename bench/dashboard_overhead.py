"""What the dashboard adds to a training step on the tiny model, as ratios (figures, not a test).

    python bench/dashboard_overhead.py [--steps 10] [--rounds 3] [--prompts 16] [--group 8]

Two gloo workers. Times ``--steps`` steps three ways: ``trainer.fit`` alone, through a Dashboard that redraws
every step (``refresh_s=0``), and through one with the default throttle (``refresh_s=2``); then one full
refresh (every diagnostic re-read, sharding and lint included) and building every view's figures. Runs through
the dashboard happen in its background thread, as from the buttons. The three ways alternate for ``--rounds``
rounds and each ratio is the median over rounds, so a machine whose load drifts skews them less.
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()

    import rlkit
    from rlkit.widgets import Dashboard

    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=args.prompts, group_size=args.group,
                              rollout=rlkit.RolloutConfig(max_new_tokens=6))
    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer(cluster, config)
        trainer.fit(2, progress=False)  # warm-up

        def through(dash: Dashboard) -> float:
            return timed(lambda: (dash.run(args.steps), dash.wait()))

        every, throttled = Dashboard(trainer, refresh_s=0), Dashboard(trainer)
        for dash in (every, throttled):
            dash.widget()
        rounds = []
        for _ in range(args.rounds):
            plain = timed(lambda: trainer.fit(args.steps, progress=False))
            rounds.append((plain / args.steps, through(every) / plain, through(throttled) / plain))
        plain, every_ratio, throttled_ratio = (statistics.median(r) for r in zip(*rounds, strict=True))
        refresh = min(timed(throttled.refresh) for _ in range(3))
        figures = min(timed(lambda: [v.figures() for v in throttled.views.values()]) for _ in range(3))
    print(f"tiny model, 2 ranks, {args.prompts} prompts x {args.group} samples, {args.steps} steps each; "
          f"median of {args.rounds} rounds; plain step {plain:.3f} s")
    print(f"step through the dashboard, redrawn every step / plain step: {every_ratio:.3f}")
    print(f"step through the dashboard, redrawn at most every 2 s / plain step: {throttled_ratio:.3f}")
    print(f"one full refresh (incl. inspect + lint) / plain step: {refresh / plain:.3f}")
    print(f"building every view's figures / plain step: {figures / plain:.3f}")


if __name__ == "__main__":
    main()
