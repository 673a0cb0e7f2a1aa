"""Training-inference mismatch at the yardstick (figures, not a test): the gap floor, the IS statistics with the
rollout correction off and on, and what returning the engine's log-probs for every row costs generation.

    python bench/mismatch.py --shape 0.5b --engine vllm [--steps 4] [--label NAME --json PATH]
    python bench/mismatch.py --shape tiny --engine hf --device cpu --prompts 8 --group 4 --response-len 16   # a CPU try

One cluster, two trainers on GPU.md's workload (``bench/workloads.py``: a Qwen2.5-shaped model with random
weights, fixed lengths): first the default run (correction off, ``rollout.engine_logprobs`` at its default 1/8 of
the prompts), then ``trainer.certify()`` (the gap floor of this model, engine and dtype, and any cause named);
then a corrected run (token TIS capped at 2 with ICEPOP's token band [0.5, 2]) with ``engine_logprobs=1``. Prints,
averaged over the steps after the first: generate seconds at each fraction and their ratio (the cost of all-row
engine log-probs), the mismatch metrics (k1, k3, |delta| mean and max, the raw ratio's range) and the correction's
(weight mean, min, max; shares truncated and masked); ``--json`` writes them (bench/results.py's record).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from results import write_result
from workloads import build_model_dir, digit_prompts, random_rewards

import rlkit

MISMATCH = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_delta/mean", "mismatch/abs_delta/max",
            "mismatch/ratio/min", "mismatch/ratio/max", "rollout/logprob_gap/checked_frac")  # fmt: skip
CORRECTION = ("rollout_correction/weight/mean", "rollout_correction/weight/min", "rollout_correction/weight/max",
              "rollout_correction/truncated_frac", "rollout_correction/masked_frac")  # fmt: skip
TIMES = ("time/worker/generate", "time/worker/update", "time/step")


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
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="rlkit-mismatch")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args()


def config(args, model_dir: Path, *, correction: bool) -> rlkit.GRPOConfig:
    """The yardstick's step (fixed lengths, one optimizer step per batch); ``correction``: TIS + ICEPOP and every
    row's engine log-probs."""
    fraction = {"engine_logprobs": 1.0} if correction else {}
    lengths = {"max_new_tokens": args.response_len, "min_new_tokens": args.response_len}
    rollout = rlkit.RolloutConfig(engine=args.engine, max_prompt_tokens=args.prompt_len, **lengths, **fraction)
    fix = rlkit.RolloutCorrectionConfig(weight="token", weight_cap=2.0, mask="token", mask_low=0.5, mask_high=2.0)
    return rlkit.GRPOConfig(model=str(model_dir), seed=0, steps=args.steps, prompts_per_step=args.prompts,
                            group_size=args.group, micro_batch_size=args.micro, recompute_logprobs=False,
                            optim=rlkit.OptimConfig(lr=1e-6), rollout=rollout,
                            rollout_correction=fix if correction else rlkit.RolloutCorrectionConfig())  # fmt: skip


def means(history, columns) -> dict[str, float]:
    """Each column's mean over the steps after the first (the first pays for warm-up)."""
    steps = history.iloc[1:] if len(history) > 1 else history
    return {c: float(steps[c].mean()) for c in columns if c in steps}


def main() -> None:
    args = parse_args()
    model_dir = build_model_dir(args.shape, args.root)
    prompts = digit_prompts(args.prompts * (args.steps + 2) * 2, args.prompt_len)
    figures: dict[str, object] = {}
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        plain = rlkit.Trainer(cluster, config(args, model_dir, correction=False), reward_fn=random_rewards,
                              prompts=prompts)  # fmt: skip
        history = plain.fit(args.steps, progress=False)
        figures["off"] = means(history, MISMATCH + TIMES)
        floor = plain.certify()
        figures["floor"] = {k: v for k, v in floor.to_pandas().iloc[0].to_dict().items()}
        figures["floor_checks"] = floor.report.checks.to_dict("records")
        corrected = rlkit.Trainer(cluster, config(args, model_dir, correction=True), reward_fn=random_rewards,
                                  prompts=prompts)  # fmt: skip
        history = corrected.fit(args.steps, progress=False)
        figures["on"] = means(history, MISMATCH + CORRECTION + TIMES)
    off, on = figures["off"], figures["on"]
    figures["generate_all_rows_over_default"] = on["time/worker/generate"] / off["time/worker/generate"]
    report(figures, args, floor)
    write_result(args.json, args.label, figures, args)


def report(figures: dict, args, floor) -> None:
    print(f"mismatch at {args.shape}, engine {args.engine}, {args.world_size} rank(s), {args.prompts}x{args.group} "
          f"completions of {args.response_len} tokens, {args.steps} steps each (means after the first)")  # fmt: skip
    print(f"  {floor}")
    print(f"  {'':<36}{'off (1/8 rows)':>16}{'on (all rows)':>16}")
    for key in MISMATCH + CORRECTION + TIMES:
        off, on = figures["off"].get(key), figures["on"].get(key)
        cells = "".join(f"{v:>16.4g}" if v is not None else f"{'-':>16}" for v in (off, on))
        print(f"  {key:<36}{cells}")
    ratio = figures["generate_all_rows_over_default"]
    print(f"  generate with every row's engine log-probs / the default 1/8: {ratio:.3f}")


if __name__ == "__main__":
    main()
