"""The peer: TRL's GRPOTrainer on the same workload as bench/grpo_step.py (figures, not a test).

    python bench/trl_grpo.py --shape 0.5b [--warmup 2 --steps 8] [--beta 0.0] [--micro 64] [--gradient-checkpointing]
        [--vllm [--vllm-gpu-memory-utilization 0.3] [--vllm-is-correction]] [--lengths varlen] [--json PATH]

Same model directory (random weights, built by bench/grpo_step.py's
``build_model_dir``), prompts, group size, fixed response length and
temperature; HF generate inside TRL. One optimizer step consumes all
``prompts x group`` completions (generation batch = per-device batch x
gradient accumulation), so a TRL step and an rlkit step do the same work.
Activation checkpointing is off, as in rlkit (TRL's GRPOConfig turns it on
by default; ``--gradient-checkpointing`` restores that).
Prints seconds per step and in generation (timed by wrapping the model's
``generate``, or with ``--vllm`` vLLM's) and the rest of the step (scoring,
the training forward/backward, the optimizer: step minus generation, step by
step), each as the median and spread of the ``--steps`` timed steps after
``--warmup`` untimed ones (``bench/stats.py``). Run on one GPU (TRL's
multi-GPU path needs accelerate launch).

``--vllm`` is TRL's colocate vLLM mode (one engine in this process, sharing
the GPU, ``gpu_memory_utilization`` 0.3 by default, no sleep mode; vLLM's
sampled-token log-probs come back as TRL always asks). TRL's importance-sampling
correction (its default with vLLM) adds a forward pass for old log-probs; it is
off here so that TRL runs the same algorithm as rlkit (``--vllm-is-correction``
turns it on). ``--lengths varlen`` forces issue 15's per-completion lengths
through vLLM (``bench/workloads.py``; needs ``--vllm``). The weight sync TRL
makes into its engine before each generation counts in the rest of the step.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

from results import write_result
from stats import describe, spread, timed
from workloads import ForcedLengths, build_model_dir, digit_prompts, random_rewards, workload_lengths


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GenerateTimer:
    """Wraps the model's ``generate`` (what TRL's HF path calls once per step) to record its wall seconds."""

    def __init__(self, generate):
        self.generate = generate
        self.times: list[float] = []

    def __call__(self, *args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = self.generate(*args, **kwargs)
        _sync()
        self.times.append(time.perf_counter() - start)
        return out


class StepTimer:
    """A transformers TrainerCallback recording wall seconds per optimizer step."""

    def __init__(self):
        self.times: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.times.append(time.perf_counter() - self._start)

    def __getattr__(self, name):  # every other callback event: do nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, help="256; with --lengths varlen the longest, 2048")
    parser.add_argument("--lengths", choices=("fixed", "varlen"), default="fixed")
    parser.add_argument("--micro", type=int, default=64, help="completions per forward/backward")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; rlkit does not")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--vllm", action="store_true", help="TRL's colocate vLLM mode instead of HF generate")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--vllm-is-correction", action="store_true", help="TRL's importance-sampling correction")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="trl")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.lengths == "varlen" and not args.vllm:
        parser.error("--lengths varlen forces lengths through vLLM: add --vllm")
    return args


def single_process_environment() -> None:
    """What TRL's colocate mode reads to build vLLM's world of one, as a launcher would set it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(name, value)


def trl_config(args, completions: int):
    import torch
    from trl import GRPOConfig

    fixed = {"min_tokens" if args.vllm else "min_new_tokens": args.response_len} if args.lengths == "fixed" else {}
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                vllm_importance_sampling_correction=args.vllm_is_correction) if args.vllm else dict(use_vllm=False)
    return GRPOConfig(
        output_dir=str(args.root / "trl-out"),
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=completions // args.micro,
        num_generations=args.group,
        max_completion_length=args.response_len,
        generation_kwargs=fixed,
        temperature=1.0,
        beta=args.beta,
        gradient_checkpointing=args.gradient_checkpointing,
        learning_rate=1e-6,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
        **vllm,
    )


def main() -> None:
    args = parse_args()
    lengths = workload_lengths(args, args.prompts * args.group)
    if args.vllm:
        single_process_environment()
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    model_dir = build_model_dir(args.shape, args.root)
    prompts = digit_prompts(args.prompts * (args.warmup + args.steps), args.prompt_len)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    completions = args.prompts * args.group
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=random_rewards,
        args=trl_config(args, completions),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    if args.vllm:
        llm = trainer.vllm_generation.llm
        if lengths:
            llm.generate = ForcedLengths(llm.generate, lengths)
        generation = GenerateTimer(llm.generate)
        llm.generate = generation
    else:
        generation = GenerateTimer(trainer.model.generate)
        trainer.model.generate = generation
    trainer.train()
    figures = summarize(args, timer, generation, trainer, completions)
    print(
        f"TRL GRPO step: {args.shape}, {'vLLM colocate' if args.vllm else 'HF generate'}, {args.prompts}x{args.group} "
        f"completions ({args.lengths}, up to {args.response_len} tokens), beta {args.beta}, micro-batch {args.micro}, "
        f"gradient checkpointing {args.gradient_checkpointing}, {args.warmup} warm-up + {args.steps} timed steps; "
        f"peak {figures['peak_gib']:.1f} GiB"
    )
    for phase, spread_ in figures["phases"].items():
        print(f"  {phase:<10}{describe(spread_)}")
    print(f"  {figures['rollout_tokens_per_s']:.0f} rollout tokens/s, {figures['train_tokens_per_s']:.0f} training "
          f"tokens/s (all steps: {', '.join(f'{t:.2f}' for t in timer.times)})")
    write_result(args.json, args.label, figures, args)


def summarize(args, timer: StepTimer, generation: GenerateTimer, trainer, completions: int) -> dict:
    import torch

    steps = timed(timer.times, args.warmup)
    paired = len(generation.times) == len(timer.times)  # one generate call per optimizer step
    generate = timed(generation.times, args.warmup) if paired else []
    rest = [s - g for s, g in zip(steps, generate, strict=True)] if paired else []
    phases = {"step": spread(steps), "generate": spread(generate), "rest": spread(rest)}
    median = {k: v.get("median", float("nan")) for k, v in phases.items()}
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    response = lengths[-1] if lengths else float(args.response_len)
    tokens = completions * (args.prompt_len + response)
    return {
        "phases": phases,
        "step_s": median["step"],
        "generate_s": median["generate"],
        "rest_s": median["rest"],
        "response_len_mean": response,
        "rollout_tokens_per_s": completions * response / median["generate"],
        "train_tokens_per_s": tokens / median["rest"],
        "steps_s": timer.times,
        "generate_calls_s": generation.times,
        "warmup": args.warmup,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
        "log_keys": sorted({k for r in trainer.state.log_history for k in r}),
    }


if __name__ == "__main__":
    main()
