"""The loss's log-prob path alone: fp32 autograd over the whole vocabulary against the chunked one.

Figures, not a test.

    python bench/logprob_loss.py [--rows 4096] [--vocab 151936] [--dtype bf16] [--repeats 3]

Both compute log softmax(logits / temperature) at the sampled tokens and the
entropy (as a metric), then backpropagate a weighted sum: "fp32 autograd" is
what the actor did before (upcast the whole [rows, V] tensor, log-softmax,
entropy on a detached copy), "chunked" is :func:`rlkit.models.logprobs.sampled_logprobs`.
Rows are response tokens of a micro-batch (64 sequences x 256 tokens = 16,384).
Prints seconds per forward+backward (median), peak memory above the logits
on CUDA, and the ratio chunked / fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlkit.algos import entropy_from_logits
from rlkit.models.logprobs import sampled_logprobs, token_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fp32_autograd(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float() / temperature
    entropy_from_logits(scaled.detach())
    return token_logprobs(scaled, tokens, 1.0)


def chunked(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return sampled_logprobs(logits, tokens, temperature)[0]


def measure(fn, logits: torch.Tensor, tokens: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward, and peak MiB allocated above the inputs (CUDA; else nan)."""
    cuda = logits.is_cuda
    times, peak = [], float("nan")
    for _ in range(repeats + 1):  # the first is a warm-up
        leaf = logits.detach().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn(leaf, tokens, 0.7).sum().backward()
        if cuda:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="response tokens in the micro-batch")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen, device=args.device).to(DTYPES[args.dtype])
    tokens = torch.randint(0, args.vocab, (args.rows,), generator=gen, device=args.device)
    print(f"log-prob loss path: {args.rows} rows x {args.vocab} vocabulary, {args.dtype} logits, {args.device}")
    ways = {"fp32 autograd": fp32_autograd, "chunked": chunked}
    results = {name: measure(fn, logits, tokens, args.repeats) for name, fn in ways.items()}
    for name, (seconds, peak) in results.items():
        print(f"  {name:<14} {seconds:8.3f} s   peak above logits {peak:9.0f} MiB")
    (old, old_peak), (new, new_peak) = results["fp32 autograd"], results["chunked"]
    memory = f", peak memory {new_peak / old_peak:.2f}" if logits.is_cuda else " (memory is measured on CUDA only)"
    print(f"  chunked / fp32 autograd: time {new / old:.2f}{memory}")


if __name__ == "__main__":
    main()
