"""Build the bundled tiny tokenizer and policy model for `AdditionTask`.

Trains a byte-level BPE tokenizer (Qwen2's pipeline) on task text, builds a tiny
Qwen2 model and trains it with noisy-label SFT: the target is the correct sum
only with probability ``--correct-prob`` and otherwise the sum plus a small
offset. The model learns the rule, but spreads its probability over the
offsets, so its temperature-1 sampled accuracy is low while greedy decoding is
mostly right: a policy that RL can sharpen in a few steps.

    python scripts/build_tiny.py --out rlkit/models/tiny --seed 0
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlkit.data.tasks import EOS_TEXT, AdditionTask, addition_reward

# Qwen2Tokenizer's pre-tokenizer regex: AutoTokenizer re-installs it on load.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
WRONG_OFFSETS = (-10, -2, -1, 1, 2, 10)
MAX_NEW_TOKENS = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rlkit/models/tiny"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000, help="SFT optimizer steps")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--correct-prob", type=float, default=0.3, help="probability that an SFT target is right")
    parser.add_argument("--eval-prompts", type=int, default=512)
    return parser.parse_args()


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen2's normaliser, pre-tokeniser and decoder; ``EOS_TEXT`` is eos and pad."""
    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT)


def build_model(vocab_size: int, eos_id: int) -> Qwen2ForCausalLM:
    """Tiny fp32 Qwen2: 3 layers, hidden 128, 4 query / 2 KV heads of dim 32, tied embeddings."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def noisy_answer(a: int, b: int, correct_prob: float, rng: random.Random) -> str:
    """``a+b`` with probability ``correct_prob``, else ``a+b`` plus an offset from `WRONG_OFFSETS` (kept >= 0)."""
    if rng.random() < correct_prob:
        return str(a + b)
    offset = rng.choice(WRONG_OFFSETS)
    return str(a + b + offset if a + b + offset >= 0 else a + b - offset)


def sft_batch(
    pairs: list[tuple[int, int]], tokenizer: PreTrainedTokenizerFast, correct_prob: float, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` [batch, seq]; labels are -100 outside answer + eos."""
    prompts = [f"{a}+{b}=" for a, b in pairs]
    answers = [noisy_answer(a, b, correct_prob, rng) + EOS_TEXT for a, b in pairs]
    prompt_ids = tokenizer(prompts)["input_ids"]
    answer_ids = tokenizer(answers)["input_ids"]
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, answer_ids))
    input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    for row, (p, c) in enumerate(zip(prompt_ids, answer_ids)):
        input_ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
    return input_ids, labels


def sft(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], args, rng) -> None:
    """Noisy-label SFT with AdamW, linear warm-up and cosine decay."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = args.steps // 20
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)),
    )
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        input_ids, labels = sft_batch(rng.choices(pairs, k=args.batch_size), tokenizer, args.correct_prob, rng)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - start:.0f} s")
    model.eval()


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict[str, str]], do_sample: bool) -> float:
    """Mean `addition_reward` of completions of ``rows`` (greedy or sampled at temperature 1)."""
    tokenizer.padding_side = "left"
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    out = model.generate(
        **enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0
    )
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    prompts = [r["prompt"] for r in rows]
    rewards = addition_reward(prompts, completions, answer=[r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    task = AdditionTask()
    rng = random.Random(args.seed)

    corpus = task.sample(20_000, rng)
    tokenizer = train_tokenizer([r["prompt"] + r["answer"] for r in corpus])
    model = build_model(len(tokenizer), tokenizer.eos_token_id)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    print(f"vocab {len(tokenizer)}  params {sum(p.numel() for p in model.parameters()):,}")

    held_out = task.sample(args.eval_prompts, random.Random(args.seed + 1))
    held_pairs = {tuple(map(int, r["prompt"][:-1].split("+"))) for r in held_out}
    n = task.max_operand + 1
    pairs = [(a, b) for a in range(n) for b in range(n) if (a, b) not in held_pairs]
    sft(model, tokenizer, pairs, args, rng)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out} in {time.perf_counter() - start:.0f} s")

    model = Qwen2ForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    greedy = accuracy(model, tokenizer, held_out, do_sample=False)
    sampled = accuracy(model, tokenizer, held_out, do_sample=True)
    print(f"held-out accuracy on {len(held_out)} prompts: greedy {greedy:.3f}  sampled (T=1) {sampled:.3f}")


if __name__ == "__main__":
    main()
