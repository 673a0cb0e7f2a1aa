"""Padded vs padding-free forward+backward of the actor's log-prob path on a variable-length micro-batch.

Figures, not a test. One process, one device, a Qwen2.5-shaped model with random weights:

    python bench/packing.py [--shape 0.5b] [--rows 16] [--attn sdpa flex_attention flash_attention_2]
                            [--compile off on] [--ac off on] [--dense] [--repeats 3]

Response lengths are drawn from a fixed seeded distribution (log-normal, clipped to [16, 2048],
mean about 500 at the defaults; prompts of --prompt tokens, left-padded to it). Each variant runs
``rlkit.models.logprobs.response_logprobs`` (entropy "grad", so the head's full backward runs) and
a backward, --repeats times after a warm-up (compiled variants: two warm-ups). Printed per variant:
median seconds, real tokens per second, peak memory (CUDA) and the ratio to the first variant,
"padded, plain head" (the old path: [b, T, V] logits and the chunked log-softmax). ``--dense`` adds
packed rows under transformers' own SDPA, which builds a dense [N, N] block-causal mask.
On CPU use a small shape (--shape tiny) and fp32; flex attention cannot train on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from shapes import SHAPES


@dataclass(frozen=True)
class Variant:
    padding_free: bool
    attn: str = "sdpa"
    compile: bool = False
    checkpointing: bool = False
    fused_head: bool = True
    dense: bool = False
    """Packed rows under transformers' plain SDPA (a dense [N, N] mask) instead of rlkit's varlen path."""

    def label(self) -> str:
        rows = "packed" if self.padding_free else "padded"
        extra = [x for x, on in (("compile", self.compile), ("AC", self.checkpointing)) if on]
        head = "" if self.fused_head else ", plain head"
        attn = "sdpa, dense mask" if self.dense else self.attn
        return f"{rows}, {attn}{head}" + (f", {' + '.join(extra)}" if extra else "")


def lengths(n: int, mean: float, low: int, high: int, seed: int) -> list[int]:
    """``n`` response lengths from a seeded log-normal with about this mean, clipped to [low, high]."""
    gen = torch.Generator().manual_seed(seed)
    sigma = 1.0
    draws = torch.exp(torch.randn(n, generator=gen) * sigma + (torch.log(torch.tensor(mean)) - sigma**2 / 2))
    return draws.round().clamp(low, high).long().tolist()


def batch(vocab: int, prompt: int, responses: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[b, prompt + T] ids and mask (T = the longest response), prompts of 3/4 to all of ``prompt`` tokens."""
    gen = torch.Generator().manual_seed(1)
    width = max(responses)
    ids = torch.randint(1, vocab, (len(responses), prompt + width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(responses):
        mask[i, prompt - (prompt * 3 // 4 + i % (prompt // 4 + 1)) : prompt + r] = 1
    return ids.to(device), mask.to(device), width


def build(shape: str, variant: Variant, device, dtype):
    """A random-weight model of ``shape`` set up as ``variant`` asks (same seed for every variant)."""
    from torch.distributed._composable import checkpoint
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlkit.models.attention import hf_attn_implementation
    from rlkit.models.head import install_response_head

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192)
    name = "sdpa" if variant.dense else hf_attn_implementation(variant.attn)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name, dtype=dtype).to(device)
    if variant.fused_head:
        install_response_head(model)
    for layer in model.model.layers:
        if variant.checkpointing:
            checkpoint(layer)
        if variant.compile:
            layer.forward = torch.compile(layer.forward)
    return model


def measure(model, variant: Variant, ids, mask, width: int, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward, and peak GiB allocated (CUDA; else nan)."""
    from rlkit.models.logprobs import response_logprobs

    cuda = ids.is_cuda
    times, peak = [], float("nan")
    warmups = 2 if variant.compile else 1
    for i in range(warmups + repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logprobs, entropy = response_logprobs(
            model, ids, mask, response_width=width, temperature=1.0, padding_free=variant.padding_free, entropy="grad"
        )
        (logprobs.sum() + 0.01 * entropy.sum()).backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
        if i >= warmups:
            times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def variants(args) -> list[Variant]:
    out = [Variant(padding_free=False, fused_head=False)]
    for attn in args.attn:
        for compiled in (c == "on" for c in args.compile):
            for ac in (a == "on" for a in args.ac):
                out += [Variant(pf, attn, compiled, ac) for pf in (False, True)]
    if args.dense:
        out.append(Variant(padding_free=True, dense=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--rows", type=int, default=16, help="sequences in the micro-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--mean", type=float, default=500.0, help="mean response length before clipping")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--attn", nargs="+", default=["sdpa"])
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off"])
    parser.add_argument("--ac", nargs="+", choices=["off", "on"], default=["off"])
    parser.add_argument("--dense", action="store_true", help="add packed rows under transformers' dense-mask SDPA")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    responses = lengths(args.rows, args.mean, args.min_len, args.max_len, seed=0)
    ids, mask, width = batch(SHAPES[args.shape]["vocab_size"], args.prompt, responses, device)
    real = int(mask.sum())
    print(
        f"{args.shape} shape, {args.rows} rows, responses {min(responses)}-{max(responses)} tokens "
        f"(mean {statistics.mean(responses):.0f}), {real:,} real of {mask.numel():,} padded tokens, {device} {dtype}"
    )
    base = None
    for variant in variants(args):
        model = build(args.shape, variant, device, dtype)
        seconds, peak = measure(model, variant, ids, mask, width, args.repeats)
        del model
        base = base or seconds
        memory = f"  peak {peak:6.2f} GiB" if device.type == "cuda" else ""
        print(f"  {variant.label():<42} {seconds:8.3f} s  {real / seconds:10,.0f} tokens/s{memory}"
              f"  time / first {seconds / base:.2f}")


if __name__ == "__main__":
    main()
