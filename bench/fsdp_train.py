"""FSDP training throughput and per-rank memory of a Qwen2.5-shaped model (random weights), on 1..N GPUs.

    python bench/fsdp_train.py --world-sizes 1 2 [--shape 0.5b] [--batch 16] [--seq 320] [--steps 5]

For each world size: one rlkit cluster, rlkit's PolicyWorker (FSDP2, bf16 compute,
fp32 master weights and reduce) doing GRPO-style updates on a synthetic batch
of ``batch`` sequences per rank. Prints per-rank memory of parameters,
gradients and optimizer state (local shards), peak allocated memory, step
time, training tokens/s and MFU (6 x params x tokens / time / peak bf16 FLOP/s),
then the ratios between world sizes. Runs on CPU too (gloo, fp32) with a small shape.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from shapes import PEAK_BF16_FLOPS, SHAPES

import rlkit
from rlkit.models.tiny import TINY_MODEL_DIR


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def train(model_dir: str, shape: str, batch: int, seq: int, response: int, steps: int, micro: int) -> dict:
    """On a worker: rlkit's PolicyWorker on the model in ``model_dir``, ``steps`` updates; this rank's figures.

    The update's weight sync into the (hf) engine is part of each timed step, as in training."""
    import torch

    from rlkit.runtime import context
    from rlkit.workers import PolicyRows, PolicyWorker

    ctx = context()
    config = rlkit.GRPOConfig(
        model=model_dir, micro_batch_size=micro, steps=steps,
        rollout=rlkit.RolloutConfig(max_new_tokens=response), data=rlkit.DataConfig(max_prompt_tokens=seq - response),
    )  # fmt: skip
    worker = PolicyWorker(config, model_dir)
    gen = torch.Generator(device="cpu").manual_seed(ctx.rank)
    rows = PolicyRows(
        input_ids=torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), generator=gen),
        attention_mask=torch.ones(batch, seq, dtype=torch.long),
        response_mask=torch.ones(batch, response),
        old_logprobs=torch.full((batch, response), -10.0),
        advantages=torch.randn(batch, 1, generator=gen).expand(batch, response).clone(),
    )
    times = []
    for _ in range(steps):
        result = worker.update(rows)
        times.append(result.times["update"] + result.times["sync"])
    step = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    actor = worker.actor
    optim_state = [v for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    out = {
        "params_gib": local_bytes(actor.model.parameters()) / 2**30,
        "grads_gib": local_bytes(p.grad for p in actor.model.parameters() if p.grad is not None) / 2**30,
        "optim_gib": local_bytes(optim_state) / 2**30,
        "step_s": step,
        "tokens_per_s": batch * seq / step,
        "n_params": sum(p.numel() for p in actor.model.parameters()),  # a DTensor counts its global numel
    }
    if ctx.device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    worker.close()
    return out


def model_dir(shape: str, root: Path) -> str:
    """A random-weight model of ``shape`` with the bundled tokenizer, built once under ``root``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = root / f"qwen2-{shape}-random"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(TINY_MODEL_DIR / name, out / name)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=320, help="tokens per sequence (prompt + response)")
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "rlkit-bench-models")
    args = parser.parse_args()
    directory = model_dir(args.shape, args.root)
    rows = {}
    for ws in args.world_sizes:
        with rlkit.launch(world_size=ws, device=args.device) as cluster:
            results = cluster.run(
                train, directory, args.shape, args.batch, args.seq, args.response, args.steps, args.micro
            )
            device = cluster.device
        rows[ws] = results
        r0 = results[0]
        tokens = sum(r["tokens_per_s"] for r in results) / len(results) * ws
        mfu = 6 * r0["n_params"] * tokens / (PEAK_BF16_FLOPS * ws) if device == "cuda" else float("nan")
        print(
            f"world size {ws} ({device}), {r0['n_params'] / 1e6:.0f}M params, {args.batch} x {args.seq} tokens per rank"
        )
        for rank, r in enumerate(results):
            peak = f"  peak allocated {r['peak_gib']:.2f} GiB" if "peak_gib" in r else ""
            print(
                f"  rank {rank}: params {r['params_gib']:.3f} GiB  grads {r['grads_gib']:.3f} GiB  "
                f"optimizer {r['optim_gib']:.3f} GiB  = "
                f"{r['params_gib'] + r['grads_gib'] + r['optim_gib']:.3f} GiB{peak}"
            )
        print(f"  step {r0['step_s']:.3f} s  training tokens/s {tokens:,.0f} (all ranks)  MFU {mfu:.1%}")
    if len(rows) > 1:
        base = min(rows)
        state = {ws: sum(rows[ws][0][k] for k in ("params_gib", "grads_gib", "optim_gib")) for ws in rows}
        for ws in sorted(rows):
            print(
                f"params+grads+optimizer per rank at world size {ws} / at {base}: {state[ws] / state[base]:.3f} "
                f"(ideal {base / ws:.3f})"
            )


if __name__ == "__main__":
    main()
