"""Where torch.compile stands on this machine for rlkit's update forward: the decoder layers (plain, checkpointed)
and the fused head's chunk math, each compiled alone, timed against eager, and any failure's cause printed whole
(figures and errors, not a test).

    python bench/compile_probe.py --shape 0.5b [--layers 2] [--rows 64] [--json PATH]

A ``--layers``-layer model of the shape (random weights, bf16 on a GPU, rlkit's packed rows through its varlen
SDPA, the fused head) runs the update's forward and backward (``response_logprobs`` with the entropy metric)
on ``--rows`` rows of 64 + 256 tokens, eagerly and then with each variant compiled (default mode, as
``fsdp.compile``): ``layers`` (each decoder layer's forward), ``checkpointed layers`` (composable checkpoint,
then compile, as rlkit orders them) and ``head`` (the chunk math alone: rlkit's default on a GPU). A variant
that fails reports its exception type, its message's first lines (inductor names the lowering and its
inputs there) and inductor's GEMM settings and TORCHINDUCTOR_* environment (where a NoValidChoicesError's
missing choices come from); the others report seconds per forward + backward, median of 3 after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
from results import write_result
from shapes import SHAPES

from rlkit.models.attention import hf_attn_implementation
from rlkit.models.head import EAGER, fused_chunk_math, install_response_head, response_head
from rlkit.models.logprobs import response_logprobs

WIDTH = 256


def build(shape: str, layers: int, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**{**SHAPES[shape], "num_hidden_layers": layers}, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation("sdpa"), dtype=dtype)
    install_response_head(model)
    return model.to(device).train()


def step(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    logprobs, _ = response_logprobs(model, ids, mask, response_width=WIDTH, temperature=1.0, padding_free=True,
                                    entropy="detached")
    logprobs.sum().backward()


def timed(model, ids, mask, device) -> float:
    for _ in range(2):
        step(model, ids, mask)
    times = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, ids, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def variant(model, name: str):
    """A copy of ``model`` with ``name`` compiled."""
    from torch.distributed._composable import checkpoint

    model = copy.deepcopy(model)
    if name == "head":
        response_head(model).use_chunk_math(fused_chunk_math())
        return model
    response_head(model).use_chunk_math(EAGER)
    for layer in model.model.layers:
        if name == "checkpointed layers":
            checkpoint(layer)
        layer.forward = torch.compile(layer.forward)
    return model


def inductor_settings() -> dict[str, object]:
    from torch._inductor import config

    names = ("max_autotune", "max_autotune_gemm", "max_autotune_gemm_backends", "max_autotune_gemm_search_space")
    return {**{n: getattr(config, n, None) for n in names},
            **{k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="compile-probe")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args.shape, args.layers, device, dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (args.rows, args.prompt_len + WIDTH), generator=gen).to(device)
    mask = torch.ones_like(ids)
    response_head(model).use_chunk_math(EAGER)
    figures: dict = {"torch": torch.__version__, "inductor": inductor_settings(), "eager_s": timed(model, ids, mask,
                                                                                                     device)}
    print(f"eager: {figures['eager_s']:.4f} s per forward + backward ({args.layers} layers, {args.rows} rows)")
    for name in ("head", "layers", "checkpointed layers"):
        try:
            compiled = variant(model, name)
            seconds = timed(compiled, ids, mask, device)
            math = response_head(compiled).chunk_math
            fell_back = [f for f in (getattr(math.stats, "failure", None), getattr(math.grad, "failure", None)) if f]
            figures[name] = {"s": seconds, "over_eager": seconds / figures["eager_s"], "fell_back": fell_back}
            print(f"{name}: {seconds:.4f} s ({seconds / figures['eager_s']:.3f} x eager)"
                  + (f"; the head fell back to eager: {fell_back}" if fell_back else ""))
        except Exception as err:  # noqa: BLE001 - the point is to report it
            lines = str(err).splitlines()
            figures[name] = {"error": type(err).__name__, "message": lines[:40],
                             "traceback": traceback.format_exc().splitlines()[-40:]}
            print(f"{name}: FAILED with {type(err).__name__}:\n  " + "\n  ".join(lines[:40]))
    print(f"inductor settings: {figures['inductor']}")
    write_result(args.json, args.label, figures, args)


if __name__ == "__main__":
    main()
