"""The fused LM head's device memory against the estimate's term for it (one GPU, a few seconds per case).

    python bench/head_memory_probe.py [--json head.json]

For Qwen2.5's vocabulary and the 0.5B and 3B hidden sizes, runs :func:`rlkit.models.head.linear_logprobs` with
the compiled chunk math (a GPU's default) on bf16 hidden states: a scoring forward (no grad, no entropy) and an
update's forward and backward (entropy for the metric; the head's weight trained or frozen as with LoRA). Each
case's peak of ``torch.cuda.max_memory_allocated`` above what was allocated before it is printed beside
:func:`rlkit.diagnostics.head_memory.fused_head_bytes`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from results import write_result

from rlkit.diagnostics.head_memory import fused_head_bytes
from rlkit.models.head import fused_chunk_math, linear_logprobs

VOCAB = 151_936
CASES = [(896, 16_384, True), (896, 16_384, False), (2048, 60_000, True), (896, 2_048, False)]
"""(hidden, rows, weight trained): 0.5B's update (64 x 256 responses), with LoRA's frozen head, 3B's packed
65,536-token micro-batch, and a small LoRA micro-batch (one chunk holds every row)."""


def peak_above(run) -> int:
    """Bytes ``run()`` allocated at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def case(hidden: int, rows: int, trained: bool, math) -> dict[str, object]:
    device = torch.device("cuda")
    weight = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16, requires_grad=trained)
    states = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, VOCAB, (rows,), device=device)

    def scoring():
        with torch.no_grad():
            linear_logprobs(states, weight, tokens, 1.0, "none", math=math)

    def update():
        out = linear_logprobs(states, weight, tokens, 1.0, "detached", math=math)
        out[:, 0].sum().backward()
        states.grad = weight.grad = None

    scoring(), update()  # compile both shapes first
    measured = {"scoring": peak_above(scoring), "update": peak_above(update)}
    predicted = {phase: fused_head_bytes(rows, VOCAB, hidden, 2, grad=phase == "update", math="fused",
                                         weight_grad=trained) for phase in measured}  # fmt: skip
    return {"hidden": hidden, "rows": rows, "weight_trained": trained, "measured_gib": _gib(measured),
            "predicted_gib": _gib(predicted),
            "measured/predicted": {p: round(measured[p] / predicted[p], 3) for p in measured}}  # fmt: skip


def _gib(values: dict[str, int]) -> dict[str, float]:
    return {k: round(v / 2**30, 3) for k, v in values.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    math, rows = fused_chunk_math(), []
    for hidden, n, trained in CASES:
        rows.append(case(hidden, n, trained, math))
        print(json.dumps(rows[-1]), flush=True)
    write_result(args.json, "head-memory", {"cases": rows}, args)


if __name__ == "__main__":
    main()
