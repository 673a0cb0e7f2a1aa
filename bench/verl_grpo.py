"""The peer most users come from: verl 0.9's GRPO (FSDP actor + colocated vLLM hybrid engine) on the same workload.

    python bench/verl_grpo.py --shape 0.5b [--warmup 2 --steps 8] [--timeout 480] [--prompts 64 --group 8
        --response-len 256] [--micro-tokens 20480] [--strategy fsdp] [--print-config] [--json PATH]

Same model directory (``bench/workloads.py``: random weights, the bundled tokenizer), prompts, group size,
fixed response length (``ignore_eos``), temperature 1 and random rewards as ``bench/grpo_step.py``; one
optimizer step per batch (``ppo_mini_batch_size`` = the prompts), beta 0 (no reference model, no KL).
Runs ``python -m verl.trainer.main_ppo`` in a child process (Ray, on one GPU) and reads its per-step metrics
(``timing_s/*``, ``perf/*``) back from verl's file logger: every phase is the median and spread of the steps
after ``--warmup`` (``bench/stats.py``). After ``--timeout`` seconds verl is stopped and the steps it logged
are reported (with how many); ``--print-config`` composes and prints verl's config (Hydra only, no GPU).

The settings (``overrides``), each chosen to make verl's step as fast as verl itself allows on this image and
fair to rlkit's (the 2026-12-02 run, without them, took 50 s a step: old log-probs 12-13 s, update 32-33 s):

- ``model.use_fused_kernels=True`` with ``fused_kernel_options.impl_backend=torch``: verl's own chunked LM
  head + log-prob (512 rows at a time, never the [tokens, V] logits). Without it, and without flash-attn
  (no wheel for torch 2.11 / CUDA 13), verl's ``logprobs_from_logits`` falls back to
  ``logprobs_from_logits_v2``, which for bf16 logits loops in Python over every token row (20,480 a
  micro-batch, a log_softmax each, forward and backward): the 12 s and 32 s of that run.
- ``model.use_remove_padding=False``: with SDPA (``--attn sdpa``; flash-attn has no wheel here) verl's packed
  rows reach transformers' SDPA as one sequence whose block-causal mask is a dense [N, N] tensor, quadratic
  in the packed length (that run: 106 s for step 1 with it on). Padded rows of fixed lengths waste nothing.
- ``use_dynamic_bsz=True`` with ``ppo_max_token_len_per_gpu`` = 64 rows of 320 tokens (rlkit's micro-batch)
  and twice that for the forward-only old-log-prob pass (``log_prob_max_token_len_per_gpu``).
- ``fsdp_config.use_no_sync_for_gradient_accumulation=True``: verl's option to reduce gradients once per
  optimizer step, the lever rlkit uses too (rlkit accumulates in fp32; verl's FSDP1 no_sync sums unsharded
  gradients in bf16).
- ``enable_gradient_checkpointing=False`` (verl's default turns it on; rlkit and TRL run without it),
  ``param_offload``/``optimizer_offload`` off, the rollout colocated in one resource pool (verl's hybrid
  engine, sleeping while the actor trains), CUDA graphs on, ``calculate_log_probs=False`` (only verl's
  rollout-correction metrics read them), ``max_num_seqs`` = every completion at once.
- ``--strategy fsdp`` (FSDP1, as the run that worked); ``fsdp2`` is verl's recommended path, untried here.

verl keeps its separate old-log-prob pass (``timing_s/old_log_prob``; rlkit and TRL take the old log-probs
from the update's own forward when there is one optimizer step per batch): it is reported apart, and
counts in verl's step as it would for its users.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results import write_result
from shapes import SHAPES
from stats import describe, spread, timed
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
    """verl's Hydra overrides for the workload (keys checked against verl 0.9.1's ppo_trainer config; the module
    doc says why each speed setting is there)."""
    seq = args.prompt_len + args.response_len
    tokens = max(args.micro_tokens, seq)
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        "data.shuffle=False", "data.dataloader_num_workers=0", "data.filter_overlong_prompts=False",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"+actor_rollout_ref.model.override_config.attn_implementation={args.attn}",
        f"actor_rollout_ref.actor.strategy={args.strategy}",
        f"actor_rollout_ref.actor.fsdp_config.strategy={args.strategy}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
        "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=True",
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
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * tokens}",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={args.warmup + args.steps}",
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
    """Every phase's median and spread over the steps after the warm-up, and verl's own throughput figures."""
    steady = timed(steps, args.warmup)
    series = lambda key: [s[key] for s in steady if key in s]  # noqa: E731
    phases = {name: spread(series(f"timing_s/{phase}")) for phase, name in PHASES.items()}
    figures: dict = {"phases": phases, **{f"{name}": v.get("median") for name, v in phases.items()}}
    rest = [s["timing_s/step"] - s.get("timing_s/gen", 0.0) for s in steady if "timing_s/step" in s]
    figures["phases"]["rest"] = spread(rest)
    figures["rest_s"] = figures["phases"]["rest"].get("median")
    lengths = series("response_length/mean")
    response = statistics.median(lengths) if lengths else None
    figures["response_len_mean"] = response
    if response and figures["update_s"]:
        figures["update_tokens_per_s"] = args.prompts * args.group * (args.prompt_len + response) / figures["update_s"]
    for key, name in (("perf/mfu/actor", "mfu_update"), ("perf/max_memory_allocated_gb", "peak_gib"),
                      ("perf/max_memory_reserved_gb", "peak_reserved_gib")):
        values = series(key)
        figures[name] = statistics.median(values) if values else None
    figures["steps_s"] = [s.get("timing_s/step") for s in steps]
    figures["logged_steps"], figures["warmup"] = len(steps), args.warmup
    figures["metric_keys"] = sorted({k for s in steps for k in s})
    return figures


def run(command: list[str], env: dict[str, str], timeout: float, output: Path) -> int | str:
    """Run verl in its own process group, its output into ``output``; after ``timeout`` seconds (0: none) stop the
    group and Ray, and say so."""
    with output.open("w") as out:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env, check=False,
                       capture_output=True)
        return f"stopped after {timeout:.0f} s"


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
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--timeout", type=float, default=0, help="stop verl after this many seconds (0: never)")
    parser.add_argument("--strategy", choices=("fsdp", "fsdp2"), default="fsdp", help="verl's actor FSDP version")
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
    data = write_dataset(digit_prompts(args.prompts * (args.warmup + args.steps), args.prompt_len),
                         work / "train.parquet")
    log = work / "metrics.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args, model_dir, data, reward)]
    print(" ".join(command), flush=True)
    output = work / "verl.log"
    code = run(command, env, args.timeout, output)
    tail = output.read_text(errors="replace").splitlines()[-80:]
    print("\n".join(tail), flush=True)
    steps = steps_from_log(log) if log.is_file() else []
    if not steps:  # the record names what stopped verl
        write_result(args.json, args.label, {"exit": code, "logged_steps": 0, "output_tail": tail}, args)
        raise SystemExit(f"verl exited with {code} after 0 logged steps")
    figures = {**summarize(steps, args), "exit": code}
    p = figures["phases"]
    print(f"verl GRPO step: {args.shape}, {args.prompts}x{args.group} completions of {args.response_len} tokens, "
          f"{len(steps)} steps logged ({args.warmup} warm-up), exit {code}")
    for name in ("step_s", "generate_s", "logprobs_s", "update_s", "sync_s", "rest"):
        print(f"  {name:<12}{describe(p.get(name, {}))}")
    print(f"  MFU {figures['mfu_update']}, peak {figures['peak_gib']} GiB; all steps {figures['steps_s']}")
    write_result(args.json, args.label, figures, args)


if __name__ == "__main__":
    main()
