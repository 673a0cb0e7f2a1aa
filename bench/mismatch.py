"""Training-inference mismatch at the yardstick (figures, not a test): the gap floor, the IS statistics with the
rollout correction off and on, and what returning the engine's log-probs for every row costs generation.

    python bench/mismatch.py --shape 0.5b --engine vllm [--steps 4] [--label NAME --json PATH]
    python bench/mismatch.py --shape tiny --engine hf --device cpu --prompts 8 --group 4 --response-len 16   # a CPU try

GPU.md's workload (``bench/workloads.py``: a Qwen2.5-shaped model with random weights, fixed lengths) on one
trainer and one engine. After a warm-up step, the steps alternate (ABBA) between two modes set on the workers:
"off" (no correction, the engine's log-probs on its default 1/8 of the prompts) and "on" (token TIS capped at 2
with ICEPOP's token band [0.5, 2], the engine's log-probs on every row). Prints per mode the medians and spreads
(bench/stats.py) of generate, update and step seconds, the mismatch metrics (k1, k3, |delta| mean and max, the raw
ratio's range) and the correction's (weight mean, min, max; shares truncated and masked); the paired ratio of
generate seconds on / off (the cost of all-row engine log-probs); and ``trainer.certify()`` (the gap of this model,
engine and dtype against the floor measured on its rows, with the verdict and the floor per rank). ``--json``
writes them (bench/results.py's record).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from results import write_result
from stats import describe, describe_ratio, paired_ratio, spread
from workloads import build_model_dir, digit_prompts, random_rewards

import rlkit

MISMATCH = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_delta/mean", "mismatch/abs_delta/max",
            "mismatch/ratio/min", "mismatch/ratio/max", "rollout/logprob_gap/checked_frac")  # fmt: skip
CORRECTION = ("rollout_correction/weight/mean", "rollout_correction/weight/min", "rollout_correction/weight/max",
              "rollout_correction/truncated_frac", "rollout_correction/masked_frac")  # fmt: skip
TIMES = ("time/worker/generate", "time/worker/update", "time/step")
FIX = {"weight": "token", "weight_cap": 2.0, "mask": "token", "mask_low": 0.5, "mask_high": 2.0}
"""The correction of the "on" mode (TIS + ICEPOP)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b", help="a bench/shapes.py shape (tiny: a CPU try)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="vllm")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="rlkit-mismatch")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args()


def set_mode(on: bool) -> None:
    """On a worker: "on" (every row's engine log-probs, the correction in the objective) or "off" (the defaults)."""
    import dataclasses

    from rlkit.algos import Correction
    from rlkit.config import RolloutConfig
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    worker.engine.logprob_fraction = 1.0 if on else RolloutConfig().engine_logprobs  # the hf engine returns all
    worker.objective = dataclasses.replace(worker.objective, correction=Correction(**FIX) if on else None)


def config(args, model_dir: Path) -> rlkit.GRPOConfig:
    """The yardstick's step: fixed lengths, one optimizer step per batch (old log-probs from the update's forward)."""
    lengths = {"max_new_tokens": args.response_len, "min_new_tokens": args.response_len}
    rollout = rlkit.RolloutConfig(engine=args.engine, **lengths)
    return rlkit.GRPOConfig(model=str(model_dir), seed=0, steps=2 * args.steps + 1, prompts_per_step=args.prompts,
                            group_size=args.group, micro_batch_size=args.micro, recompute_logprobs=False,
                            optim=rlkit.OptimConfig(lr=1e-6), rollout=rollout,
                            data=rlkit.DataConfig(max_prompt_tokens=args.prompt_len))  # fmt: skip


def main() -> None:
    args = parse_args()
    model_dir = build_model_dir(args.shape, args.root)
    prompts = digit_prompts(args.prompts * (2 * args.steps + 2), args.prompt_len)
    rows: dict[bool, list[dict]] = {False: [], True: []}
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        trainer = rlkit.Trainer(cluster, config(args, model_dir), reward_fn=random_rewards, prompts=prompts)
        cluster.run(set_mode, False)
        trainer.step()  # warm-up
        for i in range(2 * args.steps):
            on = i % 4 in (1, 2)  # off, on, on, off, ...
            cluster.run(set_mode, on)
            rows[on].append(trainer.step())
        cluster.run(set_mode, True)
        floor = trainer.certify()
    figures: dict[str, object] = {
        mode: {c: spread([r.get(c, float("nan")) for r in rows[on]]) for c in MISMATCH + CORRECTION + TIMES}
        for mode, on in (("off", False), ("on", True))
    }
    generate = [[r["time/worker/generate"] for r in rows[on]] for on in (True, False)]
    figures["generate_all_rows_over_default"] = paired_ratio(*generate)
    figures["floor"] = floor.to_pandas().iloc[0].to_dict()
    figures["floor_checks"] = floor.report.checks.to_dict("records")
    figures["floor_by_rank"] = floor.report.floor.by_rank.to_dict("records")
    report(figures, args, floor)
    write_result(args.json, args.label, figures, args)


def report(figures: dict, args, floor) -> None:
    print(f"mismatch at {args.shape}, engine {args.engine}, {args.world_size} rank(s), {args.prompts}x{args.group} "
          f"completions of {args.response_len} tokens, {args.steps} timed steps per mode (alternating)")  # fmt: skip
    print(f"  {floor}")
    for key in MISMATCH + CORRECTION + TIMES:
        off, on = figures["off"][key], figures["on"][key]
        unit = "s" if key.startswith("time/") else ""
        print(f"  {key:<36} off {describe(off, unit):<44} on {describe(on, unit)}")
    ratio = describe_ratio(figures["generate_all_rows_over_default"])
    print(f"  generate with every row's engine log-probs / the default 1/8: {ratio}")


if __name__ == "__main__":
    main()
