"""The peer: TRL's GRPOTrainer on the same workload as bench/grpo_step.py (figures, not a test).

    python bench/trl_grpo.py --shape 0.5b [--steps 4] [--beta 0.0] [--micro 64] [--gradient-checkpointing]

Same model directory (random weights, built by bench/grpo_step.py's
``build_model_dir``), prompts, group size, fixed response length and
temperature; HF generate inside TRL. One optimizer step consumes all
``prompts x group`` completions (generation batch = per-device batch x
gradient accumulation), so a TRL step and an rlkit step do the same work.
Activation checkpointing is off, as in rlkit (TRL's GRPOConfig turns it on
by default; ``--gradient-checkpointing`` restores that).
Prints seconds per step and in HF generate (medians after the first step;
generate is timed by wrapping the model's ``generate``), so the rest of the
step (scoring, the training forward/backward, the optimizer) follows. Run on
one GPU (TRL's multi-GPU path needs accelerate launch).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from grpo_step import build_model_dir, random_rewards


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64, help="completions per forward/backward")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; rlkit does not")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model_dir = build_model_dir(args.shape, args.root)
    rng = random.Random(0)
    prompts = [
        "".join(rng.choice("0123456789") for _ in range(args.prompt_len)) for _ in range(args.prompts * args.steps)
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    completions = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(args.root / "trl-out"),
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=completions // args.micro,
        num_generations=args.group,
        max_completion_length=args.response_len,
        generation_kwargs={"min_new_tokens": args.response_len},
        temperature=1.0,
        beta=args.beta,
        gradient_checkpointing=args.gradient_checkpointing,
        learning_rate=1e-6,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=False,
        shuffle_dataset=False,
        seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=random_rewards,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    generation = GenerateTimer(trainer.model.generate)
    trainer.model.generate = generation
    trainer.train()
    step = _median_after_first(timer.times)
    generate = _median_after_first(generation.times) if len(generation.times) == len(timer.times) else float("nan")
    samples, seq = completions, args.prompt_len + args.response_len
    logs = [r for r in trainer.state.log_history if "loss" in r or "reward" in r]
    figures = {
        "step_s": step,
        "generate_s": generate,
        "rest_s": step - generate,
        "rollout_tokens_per_s": samples * args.response_len / generate,
        "train_tokens_per_s": samples * seq / (step - generate),
        "steps_s": timer.times,
        "generate_calls_s": generation.times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
        "log_keys": sorted({k for r in logs for k in r}),
    }
    print(
        f"TRL GRPO step: {args.shape}, {args.prompts}x{args.group} completions of {args.response_len} tokens, "
        f"beta {args.beta}, micro-batch {args.micro}, gradient checkpointing {args.gradient_checkpointing}: "
        f"median step {step:.3f} s (all: {', '.join(f'{t:.2f}' for t in timer.times)}); "
        f"peak {figures['peak_gib']:.1f} GiB"
    )
    print(
        f"  generate {generate:.3f} s ({figures['rollout_tokens_per_s']:.0f} tokens/s), the rest of the step "
        f"{step - generate:.3f} s ({figures['train_tokens_per_s']:.0f} training tokens/s)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def _median_after_first(times: list[float]) -> float:
    steady = sorted(times[1:] or times)
    return steady[len(steady) // 2]


if __name__ == "__main__":
    main()
