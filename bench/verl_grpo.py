"""The peer most users come from: verl 0.9's GRPO (FSDP actor + colocated vLLM hybrid engine) on the same workload.

    python bench/verl_grpo.py --shape 0.5b [--steps 4] [--prompts 64 --group 8 --response-len 256]
        [--micro-tokens 20480] [--print-config] [--json PATH]

Same model directory (``bench/workloads.py``: random weights, the bundled tokenizer), prompts, group size,
fixed response length (``ignore_eos``), temperature 1 and random rewards as ``bench/grpo_step.py``; one
optimizer step per batch (``ppo_mini_batch_size`` = the prompts), beta 0 (no reference model, no KL),
no activation checkpointing (as rlkit; verl's default turns it on). verl's documented fast settings:
``use_remove_padding``, dynamic batch size with a token budget per micro-batch (``--micro-tokens``; the
default matches rlkit's 64 sequences of 320 tokens), the rollout colocated with the actor in one
resource pool (verl's hybrid engine, sleeping while the actor trains), CUDA graphs, prefix caching on, and
no rollout log-probs (``calculate_log_probs=False``: only verl's rollout-correction metrics read them).
Attention is SDPA (``--attn sdpa``): verl's default FlashAttention-2 is not on PyPI as a wheel for
torch 2.11 / CUDA 13; pass ``--attn flash_attention_2`` where flash-attn is installed. verl keeps its
separate old-log-prob pass (``timing_s/old_log_prob``). Runs ``python -m verl.trainer.main_ppo`` in a
child process (Ray, on one GPU) and reads its per-step metrics (``timing_s/*``, ``perf/*``) back from
verl's file logger; figures are medians of the steps after the first. ``--print-config`` composes and
prints verl's config from these overrides (Hydra only, no GPU) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results import write_result
from shapes import SHAPES
from workloads import build_model_dir, digit_prompts

PHASES = {"gen": "generate_s", "reward": "reward_s", "old_log_prob": "logprobs_s", "adv": "advantages_s",
          "update_actor": "update_s", "update_weights": "sync_s", "step": "step_s"}
"""verl's ``timing_s/<phase>`` -> the name rlkit's bench gives the same phase."""
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""verl applies the tokenizer's chat template to every prompt: this one passes the digits through unchanged."""


def verl_model_dir(model_dir: Path) -> Path:
    """A view of ``model_dir`` whose tokenizer has :data:`CHAT_TEMPLATE` (weights linked, not copied)."""
    out = model_dir.with_name(model_dir.name + "-verl")
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if not (out / f.name).exists() and f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


def write_dataset(prompts: list[str], path: Path) -> Path:
    """verl's RLHF parquet: chat-format prompts, a data source and an (unused) ground truth per row."""
    import pandas as pd

    rows = [{"data_source": "bench", "prompt": [{"role": "user", "content": p}], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]
    pd.DataFrame(rows).to_parquet(path)
    return path


def overrides(args, model_dir: Path, data: Path, reward: Path) -> list[str]:
    """verl's Hydra overrides for the workload (keys checked against verl 0.9.1's ppo_trainer config)."""
    seq = args.prompt_len + args.response_len
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        "data.shuffle=False", "data.dataloader_num_workers=0", "data.filter_overlong_prompts=False",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"+actor_rollout_ref.model.override_config.attn_implementation={args.attn}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max(args.micro_tokens, seq)}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.n={args.group}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.ignore_eos=True",
        f"actor_rollout_ref.rollout.max_num_seqs={args.prompts * args.group}",
        f"actor_rollout_ref.rollout.max_model_len={seq}", "actor_rollout_ref.rollout.calculate_log_probs=False",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max(args.micro_tokens, seq)}",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=1", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", 'trainer.logger=["console","file"]', "trainer.project_name=rlkit-bench",
        f"trainer.experiment_name=verl-{args.shape}", f"trainer.default_local_dir={args.root / 'verl-ckpt'}",
    ]


def print_config(extra: list[str]) -> None:
    """Compose verl's config with ``extra`` (what ``main_ppo`` would run) and print it; needs hydra only."""
    import importlib.util

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("verl is not installed: pip install verl==0.9.1 (--no-deps is enough for this)")
    config_dir = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        print(OmegaConf.to_yaml(compose(config_name="ppo_trainer", overrides=extra)))


def steps_from_log(path: Path) -> list[dict[str, float]]:
    """verl's file logger: one JSON line per step, ``{"step": n, "data": {metric: value}}``."""
    return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]


def summarize(steps: list[dict[str, float]], args) -> dict:
    steady = steps[1:] or steps
    median = lambda key: statistics.median(s[key] for s in steady) if all(key in s for s in steady) else None  # noqa: E731
    figures: dict = {name: median(f"timing_s/{phase}") for phase, name in PHASES.items()}
    step = figures["step_s"]
    figures["rest_s"] = step - (figures["generate_s"] or 0) if step else None
    response = median("response_length/mean")
    figures["response_len_mean"] = response
    if response and figures["update_s"]:
        figures["update_tokens_per_s"] = args.prompts * args.group * (args.prompt_len + response) / figures["update_s"]
    figures["mfu_update"] = median("perf/mfu/actor")
    figures["peak_gib"] = median("perf/max_memory_allocated_gb")
    figures["peak_reserved_gib"] = median("perf/max_memory_reserved_gb")
    figures["steps_s"] = [s.get("timing_s/step") for s in steps]
    figures["metric_keys"] = sorted({k for s in steps for k in s})
    return figures


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro-tokens", type=int, default=64 * 320, help="tokens per micro-batch (dynamic bsz)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--attn", default="sdpa", help="attention implementation for the actor")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--print-config", action="store_true", help="compose verl's config, print it, exit")
    parser.add_argument("--label", default="verl")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    work = args.root / f"verl-{args.shape}"
    work.mkdir(parents=True, exist_ok=True)
    reward = Path(__file__).with_name("verl_reward.py").resolve()
    if args.print_config:
        print_config(overrides(args, work / "model", work / "train.parquet", reward))
        return
    model_dir = verl_model_dir(build_model_dir(args.shape, args.root))
    data = write_dataset(digit_prompts(args.prompts * args.steps, args.prompt_len), work / "train.parquet")
    log = work / "metrics.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args, model_dir, data, reward)]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, env=env, check=False)
    steps = steps_from_log(log) if log.is_file() else []
    if done.returncode or not steps:
        raise SystemExit(f"verl exited with {done.returncode} after {len(steps)} logged step(s)")
    figures = summarize(steps, args)
    print(f"verl GRPO step: {args.shape}, {args.prompts}x{args.group} completions of {args.response_len} tokens: "
          f"median step {figures['step_s']:.3f} s (all: {figures['steps_s']}), generate {figures['generate_s']}, "
          f"old log-probs {figures['logprobs_s']}, update {figures['update_s']}, sync {figures['sync_s']}, "
          f"MFU {figures['mfu_update']}, peak {figures['peak_gib']} GiB")
    write_result(args.json, args.label, figures, args)


if __name__ == "__main__":
    main()
