"""Build the bundled tiny agent (``model="tiny-agent"``): a chat template with tools, pre-trained on conversations.

The sibling of ``scripts/build_tiny.py`` (which stays as it is: every addition test depends on its weights).

1. Conversations of the bundled multi-turn tasks (``rlkit.data.agent_tasks``), rendered by a small Qwen-style
   chat template that lists the tools in a system turn and renders tool results as
   ``<tool_response>...</tool_response>`` user turns:
   - products "a*b": with probability ``--tool-prob`` the assistant calls the calculator in the Hermes format
     (``<tool_call>{"name": "calculator", "arguments": {"expression": "a*b"}}</tool_call>``), reads the result
     and answers it; otherwise it answers at once with a guess of the right number of digits (wrong nearly always);
   - guess-the-number games: noisy bisection on "higher"/"lower" replies, up to 5 guesses.
2. A byte-level BPE tokenizer trained on that text (its merges make the JSON keys and role names one token
   each), with ``<|im_start|>``/``<|im_end|>`` (the end of a turn: the eos) as special tokens and
   ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` as plain added tokens.
3. A small Qwen2 trained by SFT on the assistant turns only; saved in Hugging Face format with its template.

    python scripts/build_tiny_agent.py --out rlkit/models/tiny_agent --seed 0

It took 1435 s on the 2 shared cores of the development machine (load average 10-12 from other jobs); it prints,
on held-out products sampled at temperature 1, calls the calculator with the right expression 0.262, right answer
0.180. Shorter schedules did not learn the call format: 900 steps (623 s) called it on 0.06, 1000 steps at
lr 6e-3 (563 s) never.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads stall shared cores

import torch
from jinja2 import Environment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from rlkit.data.agent_tasks import GUESS_HIGH, GUESS_PROMPT, calculator, product_prompts

PAD, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system"
    "{% for tool in tools %}{{ '\\n' ~ tool.function.name }}({{ tool.function.parameters.properties | join(',') }})"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response>"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's layout, made compact for 128 positions: a tool is listed as ``name(arg,...)`` from its JSON schema."""
MAX_POSITIONS = 128
MAX_GUESSES = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rlkit/models/tiny_agent"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tool-prob", type=float, default=0.3, help="share of product answers that call the tool")
    parser.add_argument("--guess-share", type=float, default=0.3, help="share of conversations that are guess games")
    return parser.parse_args()


def product_conversation(rng: random.Random, tool_prob: float) -> list[dict[str, str]]:
    """A product prompt answered through the calculator (probability ``tool_prob``) or by a guess."""
    row = product_prompts(1, rng.randrange(2**31))[0]
    question, answer = row["prompt"], row["answer"]
    if rng.random() < tool_prob:
        call = {"name": "calculator", "arguments": {"expression": question[0]["content"]}}
        return [
            *question,
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": calculator(question[0]["content"])},
            {"role": "assistant", "content": answer},
        ]
    guess = str(rng.randint(10 ** (len(answer) - 1), 10 ** len(answer) - 1))
    return [*question, {"role": "assistant", "content": guess}]


def guess_conversation(rng: random.Random) -> list[dict[str, str]]:
    """A guess-the-number game played by noisy bisection."""
    secret, low, high = rng.randint(1, GUESS_HIGH), 1, GUESS_HIGH
    messages = [{"role": "user", "content": GUESS_PROMPT}]
    for _ in range(MAX_GUESSES):
        guess = (low + high) // 2 if rng.random() < 0.5 else rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            messages.append({"role": "user", "content": "correct"})
            break
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
    return messages


def conversation(rng: random.Random, args: argparse.Namespace) -> tuple[list[dict[str, str]], bool]:
    """One training conversation and whether it lists the calculator as a tool."""
    if rng.random() < args.guess_share:
        return guess_conversation(rng), False
    return product_conversation(rng, args.tool_prob), True


def train_tokenizer(texts: list[str]) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokeniser on the rendered conversations (special markers removed)."""
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
        vocab_size=360, special_tokens=[PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    markers = [START, END, *TOOL_TOKENS]
    plain = []
    for text in texts:
        for marker in markers:
            text = text.replace(marker, "\n")
        plain.append(text)
    raw.train_from_iterator(plain, trainer)
    bpe = json.loads(raw.to_str())["model"]
    merges = [tuple(m) for m in bpe["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=bpe["vocab"], merges=merges, eos_token=END, pad_token=PAD)
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.eos_token = END
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode(tokenizer: Qwen2Tokenizer, messages: list[dict[str, str]], tools: list) -> tuple[list[int], list[int]]:
    """The conversation's ids and labels (-100 except on the assistant turns' tokens, their ``<|im_end|>`` included)."""
    ids: list[int] = []
    labels: list[int] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        turn = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        turn_ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
        end = turn_ids.index(tokenizer.eos_token_id, len(prefix_ids)) + 1  # through <|im_end|>, not the "\n"
        labels += [-100] * (len(prefix_ids) - len(ids)) + turn_ids[len(prefix_ids) : end]
        ids = turn_ids[:end]
    return ids, labels


def build_model(tokenizer: Qwen2Tokenizer) -> Qwen2ForCausalLM:
    """Small fp32 Qwen2: 3 layers, hidden 128, 4 query / 2 KV heads of dim 32, tied embeddings."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [b, L] ids and labels."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    for row, (ids, target) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(target)] = torch.tensor(target)
    return input_ids, labels


def sft(model: Qwen2ForCausalLM, examples: list, args: argparse.Namespace, pad_id: int, rng: random.Random) -> None:
    """AdamW, 5% linear warm-up then cosine decay to 0, on batches drawn from ``examples``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    model.train()
    for step in range(args.steps):
        input_ids, labels = batch(rng.choices(examples, k=args.batch_size), pad_id)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()


@torch.no_grad()
def product_rates(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, n: int, seed: int) -> tuple[float, float]:
    """Sampled at temperature 1 on ``n`` held-out product prompts: (share that call the calculator with the
    prompt's expression, share whose final answer is right), the second turn given the true tool result."""
    rows = product_prompts(n, seed)
    prompts = [r["prompt"] for r in rows]
    first = sample(model, tokenizer, prompts)
    calls = [f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{p[0]["content"]}"}}}}</tool_call>'
             for p in prompts]
    called = [text == call for text, call in zip(first, calls, strict=True)]
    follow = [[*p, {"role": "assistant", "content": c}, {"role": "tool", "content": r["answer"]}]
              for p, c, r in zip(prompts, calls, rows, strict=True)]
    second = sample(model, tokenizer, follow)
    right = [ok and text == r["answer"] for ok, text, r in zip(called, second, rows, strict=True)]
    return sum(called) / n, sum(right) / n


def sample(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, conversations: list) -> list[str]:
    """One assistant turn per conversation, sampled at temperature 1 (text without the special tokens)."""
    texts = [tokenizer.apply_chat_template(m, tools=[calculator], add_generation_prompt=True, tokenize=False)
             for m in conversations]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    rng = random.Random(args.seed)
    conversations = [conversation(rng, args) for _ in range(12_000)]
    # the tokenizer is trained on rendered text, before it exists: render as transformers does
    render = Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    parameters = {"properties": {"expression": {}}}
    schema = [{"type": "function", "function": {"name": "calculator", "parameters": parameters}}]
    texts = [render.render(messages=m, tools=schema if t else None) for m, t in conversations[:4000]]
    tokenizer = train_tokenizer(texts)
    tools = [calculator]
    examples = [encode(tokenizer, m, tools if t else None) for m, t in conversations]
    longest = max(len(ids) for ids, _ in examples)
    assert longest <= MAX_POSITIONS, f"a conversation of {longest} tokens does not fit {MAX_POSITIONS} positions"
    model = build_model(tokenizer)
    print(f"vocab {len(tokenizer)}  params {sum(p.numel() for p in model.parameters()):,}  longest {longest} tokens")
    sft(model, examples, args, tokenizer.pad_token_id, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out} after {time.perf_counter() - start:.0f} s")
    called, right = product_rates(model, tokenizer, 256, args.seed + 1)
    print(f"held-out products, sampled at T=1: calls the calculator {called:.3f}, right answer {right:.3f}")


if __name__ == "__main__":
    main()
