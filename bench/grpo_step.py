"""One GRPO step of rlkit on a Qwen2.5-shaped model (random weights), phase by phase (figures, not a test).

    python bench/grpo_step.py --shape 0.5b --world-size 1 --engine vllm [--steps 4] [--beta 0.0] [--micro 64]
        [--recompute-logprobs] [--profile]

The workload is GPU.md's yardstick: ``prompts`` prompts of exactly
``prompt_len`` tokens, ``group`` completions each of exactly ``response_len``
tokens (end-of-text suppressed), temperature 1, random rewards (so every
update does real work), one optimizer step per batch; the old log-probs come
from the update's own forward unless ``--recompute-logprobs`` (TRL skips that
pass too when ``num_iterations=1``). Prints seconds per phase (rollout = generate +
trainer log-probs + reference, update, weight sync), controller overhead,
rollout and training tokens/s, MFU and peak memory per rank, averaged over
the steps after the first. ``--profile`` adds one profiled step per rank
(torch.profiler) and prints its top operators.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
from pathlib import Path

from shapes import PEAK_BF16_FLOPS, SHAPES

import rlkit
from rlkit.models.tiny import TINY_MODEL_DIR


def build_model_dir(shape: str, root: Path) -> Path:
    """A model directory with random weights of ``shape`` and the bundled tokenizer (digits are one token each)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = root / f"qwen2-{shape}-random"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY_MODEL_DIR / name, out / name)
    return out


def random_rewards(prompts, completions, **fields):
    rng = random.Random(len(completions) + sum(map(len, completions)))
    return [rng.random() for _ in completions]


def start_profiler():
    import torch

    from rlkit.runtime import context

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.start()
    context().state["bench.profiler"] = prof


def stop_profiler(rows: int) -> str:
    import torch

    from rlkit.runtime import context

    prof = context().state.pop("bench.profiler")
    prof.stop()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def summarize(history, n_params: int, world_size: int, args) -> dict[str, float]:
    h = history.iloc[1:] if len(history) > 1 else history
    mean = lambda c: float(h[c].mean()) if c in h else 0.0  # noqa: E731
    samples = args.prompts * args.group
    seq = args.prompt_len + args.response_len
    step = mean("time/step")
    update = mean("time/worker/update")
    workers = sum(mean(f"time/worker/{p}") for p in ("generate", "logprobs", "reference", "update", "sync"))
    forwards = int(args.recompute_logprobs) + int(args.beta > 0)  # old log-probs, reference
    flops = samples * seq * n_params * (6 + 2 * forwards)  # train (fwd+bwd) + scoring forwards; generation excluded
    peaks = [float(h[c].max()) for c in h.columns if c.endswith("peak_mb")]
    return {
        "step_s": step,
        "generate_s": mean("time/worker/generate"),
        "logprobs_s": mean("time/worker/logprobs"),
        "reference_s": mean("time/worker/reference"),
        "update_s": update,
        "sync_s": mean("time/worker/sync"),
        "controller_overhead_s": step - workers - mean("time/score") - mean("time/advantages"),
        "rollout_tokens_per_s": samples * args.response_len / max(mean("time/worker/generate"), 1e-9),
        "train_tokens_per_s": samples * seq / max(update, 1e-9),
        "mfu_update": 6 * n_params * samples * seq / max(update, 1e-9) / (PEAK_BF16_FLOPS * world_size),
        "mfu_step": flops / step / (PEAK_BF16_FLOPS * world_size),
        "peak_gib_max_rank": max(peaks) / 1024 if peaks else float("nan"),
        "reward_mean": mean("reward/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="vllm")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64, help="sequences per forward/backward")
    parser.add_argument("--recompute-logprobs", action="store_true", help="score rollouts in a separate pass")
    parser.add_argument("--beta", type=float, default=0.0, help="kl_coef (0: no reference model)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    model_dir = build_model_dir(args.shape, args.root)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("0123456789") for _ in range(args.prompt_len)) for _ in range(args.prompts * 4)]
    config = rlkit.GRPOConfig(
        model=str(model_dir), seed=0, steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
        kl_coef=args.beta, micro_batch_size=args.micro, recompute_logprobs=args.recompute_logprobs,
        rollout=rlkit.RolloutConfig(engine=args.engine, max_new_tokens=args.response_len,
                                    min_new_tokens=args.response_len, max_prompt_tokens=args.prompt_len),
        optim=rlkit.OptimConfig(lr=1e-6),
    )
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        trainer = rlkit.Trainer(cluster, config, reward_fn=random_rewards, prompts=prompts)
        history = trainer.fit(args.steps, progress=False)
        profile = None
        if args.profile:
            cluster.run(start_profiler)
            trainer.step()
            profile = cluster.run(stop_profiler, 25)[0]
    n_params = _param_count(model_dir)
    figures = summarize(history, n_params, args.world_size, args)
    print(f"rlkit GRPO step: {args.shape} ({n_params / 1e6:.0f}M), {args.world_size} rank(s), engine {args.engine}, "
          f"{args.prompts}x{args.group} completions of {args.response_len} tokens, beta {args.beta}, "
          f"micro-batch {args.micro}, recompute_logprobs {args.recompute_logprobs}")
    for key, value in figures.items():
        print(f"  {key:<24}{value:>12.4g}")
    if profile:
        print("profile of one step, rank 0 (top operators by self device time):")
        print(profile)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **figures}, indent=1))


def _param_count(model_dir: Path) -> int:
    """Parameters in the model directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


if __name__ == "__main__":
    main()
