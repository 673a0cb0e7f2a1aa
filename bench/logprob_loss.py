"""The loss's LM head + log-prob path alone: fp32 autograd, the chunked log-softmax, the fused head.

Figures, not a test.

    python bench/logprob_loss.py [--rows 16384] [--hidden 896] [--vocab 151936] [--dtype bf16] [--repeats 3]

Each way computes log softmax(hidden @ W.T / temperature) at the sampled tokens and the entropy,
then backpropagates a weighted sum into ``hidden`` [rows, H] and ``W`` [V, H]:

- "fp32 autograd": the LM head's [rows, V] logits, upcast whole, log-softmax, entropy on a detached copy
  (what the actor did first);
- "chunked": the same logits, then :func:`rlkit.models.logprobs.sampled_logprobs` (fp32 a chunk at a
  time; it keeps the [rows, V] logits for backward);
- "fused": :func:`rlkit.models.head.linear_logprobs` (logits a chunk at a time, recomputed in backward;
  never [rows, V]).

Rows are the response tokens of a micro-batch (64 sequences x 256 tokens = 16,384). Prints seconds
per forward+backward (median), peak memory above the inputs on CUDA, and the ratios to "chunked".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlkit.algos import entropy_from_logits
from rlkit.models.head import linear_logprobs
from rlkit.models.logprobs import sampled_logprobs, token_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fp32_autograd(hidden, weight, tokens, temperature):
    scaled = (hidden @ weight.t()).float() / temperature
    entropy_from_logits(scaled.detach())
    return token_logprobs(scaled, tokens, 1.0)


def chunked(hidden, weight, tokens, temperature):
    return sampled_logprobs((hidden @ weight.t())[:, None], tokens[:, None], temperature)[0]


def fused(hidden, weight, tokens, temperature):
    return linear_logprobs(hidden, weight, tokens, temperature, entropy="detached")[:, 0]


def measure(fn, hidden, weight, tokens, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward, and peak MiB allocated above the inputs (CUDA; else nan)."""
    cuda = hidden.is_cuda
    times, peak = [], float("nan")
    for _ in range(repeats + 1):  # the first is a warm-up
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn(h, w, tokens, 0.7).sum().backward()
        if cuda:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="response tokens in the micro-batch")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    gen = torch.Generator(device=args.device).manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(args.rows, args.hidden, generator=gen, device=args.device).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=args.device) / args.hidden**0.5).to(dtype)
    tokens = torch.randint(0, args.vocab, (args.rows,), generator=gen, device=args.device)
    print(f"LM head + log-prob: {args.rows} rows x {args.hidden} hidden x {args.vocab} vocabulary, "
          f"{args.dtype}, {args.device}")
    ways = {"fp32 autograd": fp32_autograd, "chunked": chunked, "fused": fused}
    results = {name: measure(fn, hidden, weight, tokens, args.repeats) for name, fn in ways.items()}
    for name, (seconds, peak) in results.items():
        print(f"  {name:<14} {seconds:8.3f} s   peak above inputs {peak:9.0f} MiB")
    base, base_peak = results["chunked"]
    for name in ("fp32 autograd", "fused"):
        seconds, peak = results[name]
        memory = f", peak memory {peak / base_peak:.2f}" if hidden.is_cuda else " (memory is measured on CUDA only)"
        print(f"  {name} / chunked: time {seconds / base:.2f}{memory}")


if __name__ == "__main__":
    main()
