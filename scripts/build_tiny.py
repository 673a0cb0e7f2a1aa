"""Build the bundled tiny tokenizer and policy model for `AdditionTask`.

1. Train a byte-level BPE tokenizer with Qwen2's pipeline on task text.
2. Build a tiny Qwen2 model and train it in two SFT phases:
   - clean: correct targets, until the model knows the rule;
   - noisy: a short, low-learning-rate phase where the target is the correct sum
     only with probability ``--correct-prob`` and otherwise the sum plus a small
     offset. The policy then samples the right answer about 30% of the time
     while greedy decoding stays mostly right: RL only has to sharpen it.
3. Save model and tokenizer in Hugging Face format and print held-out accuracy.

    python scripts/build_tiny.py --out rlkit/models/tiny --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

# Spinning OpenMP threads stall training many-fold when the 2 cores are shared; must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from rlkit.data.tasks import EOS_TEXT, AdditionTask, addition_reward

WRONG_OFFSETS = (-10, -2, -1, 1, 2, 10)
"""Offsets added to the sum for a wrong noisy-phase target."""
MAX_NEW_TOKENS = 4
"""Enough for a 3-digit sum and the end-of-text token."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rlkit/models/tiny"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clean-steps", type=int, default=3600)
    parser.add_argument("--clean-lr", type=float, default=3e-3)
    parser.add_argument("--noisy-steps", type=int, default=640)
    parser.add_argument("--noisy-lr", type=float, default=3e-4)
    parser.add_argument("--correct-prob", type=float, default=0.3, help="probability that a noisy target is right")
    parser.add_argument("--eval-prompts", type=int, default=512)
    return parser.parse_args()


def train_tokenizer(texts: list[str]) -> Qwen2Tokenizer:
    """Byte-level BPE trained with the normaliser and pre-tokeniser that `Qwen2Tokenizer` installs on load.

    Qwen2's regex splits digits apart, so task text yields no merges: the vocabulary is
    the 256-byte alphabet plus ``EOS_TEXT`` (id 0), which is also the pad token.
    """
    raw = Tokenizer(BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    bpe = json.loads(raw.to_str())["model"]
    return Qwen2Tokenizer(vocab=bpe["vocab"], merges=bpe["merges"], eos_token=EOS_TEXT, pad_token=EOS_TEXT)


def build_model(vocab_size: int, eos_id: int) -> Qwen2ForCausalLM:
    """Tiny fp32 Qwen2: 2 layers, hidden 128, 4 query / 2 KV heads of dim 32, tied embeddings."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,  # rotary positions (nothing learned): 128 holds the Tinker cookbook's prompts
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    return model


def noisy_answer(a: int, b: int, correct_prob: float, rng: random.Random) -> str:
    """``a+b`` with probability ``correct_prob``, else ``a+b`` plus an offset from `WRONG_OFFSETS` (kept >= 0)."""
    if rng.random() < correct_prob:
        return str(a + b)
    offset = rng.choice(WRONG_OFFSETS)
    return str(a + b + offset if a + b + offset >= 0 else a + b - offset)


def sft_batch(
    pairs: list[tuple[int, int]], tokenizer: Qwen2Tokenizer, correct_prob: float, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels``, both [batch, seq]; labels are -100 outside answer + eos."""
    prompt_ids = tokenizer([f"{a}+{b}=" for a, b in pairs])["input_ids"]
    answer_ids = tokenizer([noisy_answer(a, b, correct_prob, rng) + EOS_TEXT for a, b in pairs])["input_ids"]
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, answer_ids, strict=True))
    input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    for row, (p, c) in enumerate(zip(prompt_ids, answer_ids, strict=True)):
        input_ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
    return input_ids, labels


def sft(
    model: Qwen2ForCausalLM,
    tokenizer: Qwen2Tokenizer,
    pairs: list[tuple[int, int]],
    *,
    steps: int,
    lr: float,
    correct_prob: float,
    batch_size: int,
    rng: random.Random,
) -> None:
    """One SFT phase: AdamW with 5% linear warm-up then cosine decay to 0, on pairs drawn from ``pairs``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    for step in range(steps):
        input_ids, labels = sft_batch(rng.choices(pairs, k=batch_size), tokenizer, correct_prob, rng)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 400 == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict[str, str]], *, do_sample: bool) -> float:
    """Mean `addition_reward` over ``rows``, decoding greedily or sampling at temperature 1 (no top-k/top-p)."""
    prompts = [r["prompt"] for r in rows]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, **sampling)
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = addition_reward(prompts, completions, answer=[r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The tiny model's chat template: the messages' contents as they are, so that a chat prompt
[{"role": "user", "content": "17+25="}] renders as the raw prompt the model was trained on."""


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    task = AdditionTask()
    rng = random.Random(args.seed)

    tokenizer = train_tokenizer([r["prompt"] + r["answer"] for r in task.sample(20_000, rng)])
    model = build_model(len(tokenizer), tokenizer.eos_token_id)
    print(f"vocab {len(tokenizer)}  params {sum(p.numel() for p in model.parameters()):,}")

    held_out = task.sample(args.eval_prompts, random.Random(args.seed + 1))
    held_pairs = {tuple(map(int, r["prompt"].rstrip("=").split("+"))) for r in held_out}
    operands = range(task.max_operand + 1)
    pairs = [(a, b) for a in operands for b in operands if (a, b) not in held_pairs]
    common = {"batch_size": args.batch_size, "rng": rng}
    print("clean SFT")
    sft(model, tokenizer, pairs, steps=args.clean_steps, lr=args.clean_lr, correct_prob=1.0, **common)
    print(f"noisy SFT (correct with probability {args.correct_prob})")
    sft(model, tokenizer, pairs, steps=args.noisy_steps, lr=args.noisy_lr, correct_prob=args.correct_prob, **common)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out} after {time.perf_counter() - start:.0f} s")

    model = AutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    greedy = accuracy(model, tokenizer, held_out, do_sample=False)
    sampled = accuracy(model, tokenizer, held_out, do_sample=True)
    print(f"held-out accuracy on {len(held_out)} prompts: greedy {greedy:.3f}  sampled (T=1) {sampled:.3f}")


if __name__ == "__main__":
    main()
