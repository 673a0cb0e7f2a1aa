"""What the trainer's always-on diagnostics cost per optimizer step, as ratios (figures, not a test).

    python bench/diagnostics_overhead.py [--layers 4] [--hidden 256] [--batch 16] [--seq 64] [--repeats 5]

One process, a one-rank gloo group and FSDP2 (one unit per decoder layer, then
the root) on a Qwen2 built from a config. Compares one training step (forward,
backward, AdamW step) with what the worker adds to it (``grad_report`` and two
memory marks), and with the on-demand ``inspect`` + ``lint`` behind
``trainer.lint()``. Ratios, so the figures compare across machines.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def best(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit import diagnostics as dx
    from rlkit.config import FSDPConfig
    from rlkit.fsdp import apply_fsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = Qwen2Config(vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                         num_key_value_heads=max(1, args.hidden // 64), head_dim=32)
    torch.manual_seed(0)
    model = apply_fsdp(Qwen2ForCausalLM(config), init_device_mesh("cpu", (1,)), FSDPConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = dx.MemoryTracker(torch.device("cpu"), models=[model], optimizers=[optimizer])
    ids = torch.randint(0, 1024, (args.batch, args.seq))

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    step = best(train_step, args.repeats)
    model(input_ids=ids, labels=ids).loss.backward()
    worker_adds = best(lambda: (tracker.mark("forward_backward"), dx.grad_report(model), tracker.mark("step")),
                       args.repeats)
    on_demand = best(lambda: dx.lint([dx.inspect(model, optimizer)]), args.repeats)
    params = sum(p.numel() for p in model.parameters())
    print(f"Qwen2 {args.layers} layers, hidden {args.hidden}: {params / 1e6:.2f}M parameters; "
          f"batch {args.batch} x {args.seq} tokens; best of {args.repeats}")
    print(f"grad_report + 2 memory marks / training step: {worker_adds / step:.4f}")
    print(f"inspect + lint (trainer.lint, on demand) / training step: {on_demand / step:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
