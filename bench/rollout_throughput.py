"""Rollout throughput of the hf and vllm engines on the same model and prompts, and weight-sync seconds.

    python bench/rollout_throughput.py                                  # CPU, the bundled tiny model
    python bench/rollout_throughput.py --device cuda --shape 0.5b       # GPU, random Qwen2.5-0.5B shape, bf16

Both engines are built as the trainer builds them (``rlkit.rollout.build_engine``, bf16 on GPU, fp32
on CPU) from one model directory and sample the same prompts (``--prompts`` x ``--samples``
completions of at most ``--new-tokens``, temperature 1; vLLM's log-probs on ``--engine-logprobs`` of the
prompts). The weight sync is the trainer's: an FSDP2-wrapped fp32 actor (one rank) gathered parameter
by parameter into the engine. Where the sync's time goes: "gather" is the FSDP gather alone; "sync 1"
the first sync into an awake engine (packs the shared buffers and hands them over), "sync" the median
of the later ones (copies into the buffers and one RPC; "how" says whether the engine then copied
straight into its parameters or ran vLLM's loader); then one sleep (the memory it freed) and the
sync that wakes the engine. Prints one row per engine, with ratios to hf; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import write_result
from shapes import SHAPES
from workloads import build_model_dir


def model_dir(shape: str, workdir: Path) -> Path:
    """The bundled tiny model (``--shape tiny``: the addition task), or a random-weight model of ``shape``."""
    from rlkit.models.tiny import TINY_MODEL_DIR

    return TINY_MODEL_DIR if shape == "tiny" else build_model_dir(shape, workdir)


def prompts(shape: str, count: int, length: int, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """[count, P] left-padded ids and mask: the addition task for tiny, random tokens of ``length`` otherwise."""
    if shape == "tiny":
        import random

        from rlkit.data.tasks import AdditionTask

        rows = AdditionTask().sample(count, random.Random(0))
        enc = tokenizer([r["prompt"] for r in rows], padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]
    ids = torch.randint(1, len(tokenizer), (count, length), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def init_one_rank_group(device: torch.device) -> None:
    """A one-process torch.distributed group, so the actor is FSDP-wrapped as in training."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def measure(engine, actor, ids, mask, params, repeats: int, device: torch.device) -> dict[str, float]:
    """Best-of-``repeats`` generate seconds, then where a weight sync's time goes (see the module's doc)."""
    engine.generate(ids[:2], mask[:2], params)  # warm-up
    best = None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        gen = engine.generate(ids, mask, params)
        _sync(device)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, gen.response_mask.sum().item())
    assert best is not None
    return {"seconds": best[0], "tokens": best[1], **measure_sync(engine, actor, repeats + 1, device)}


def measure_sync(engine, actor, repeats: int, device: torch.device) -> dict[str, float]:
    from rlkit.fsdp import iter_full_params

    def timed(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    gather = timed(lambda: list(iter_full_params(actor)))
    syncs = [timed(lambda: engine.load_weights(iter_full_params(actor))) for _ in range(repeats)]
    how = getattr(engine, "last_sync", "in place")
    policy = getattr(engine, "sleep_policy", None)
    if policy is not None:
        policy.mode = "always"  # one sleep, whatever rollout.sleep would decide
    free_before = _free_gib(device)
    sleep_s = timed(engine.sleep)
    freed = _free_gib(device) - free_before
    woken = timed(lambda: engine.load_weights(iter_full_params(actor)))
    return {"gather_s": gather, "sync_first_s": syncs[0], "sync_s": statistics.median(syncs[1:] or syncs),
            "how": how, "sleep_s": sleep_s, "freed_gib": freed, "sync_after_sleep_s": woken,
            "tensors": engine.load_weights(iter_full_params(actor))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_gib(device: torch.device) -> float:
    """Free device memory in GiB (whole device, all processes); 0 on CPU."""
    return torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=("tiny", *SHAPES), default="tiny")
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated, in order")
    parser.add_argument("--prompts", type=int, help="default 64 (cuda) / 16 (cpu)")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompts' length (not for tiny)")
    parser.add_argument("--new-tokens", type=int, help="default 256 (cuda) / 32 (cpu); tiny: at most 16")
    parser.add_argument("--repeats", type=int, default=2, help="timed generate calls per engine (best is kept)")
    parser.add_argument("--engine-logprobs", type=float, default=1.0, help="rollout.engine_logprobs for vllm")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()), help="where random models go")
    parser.add_argument("--label", default="rollout-throughput")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    n_prompts = args.prompts or (64 if cuda else 16)
    new_tokens = args.new_tokens or (256 if cuda else 32)
    if args.shape == "tiny":
        new_tokens = min(new_tokens, 16)  # the tiny model has 64 positions

    import rlkit
    from rlkit.fsdp import apply_fsdp, build_mesh, param_dtype
    from rlkit.models import load_causal_lm, load_tokenizer
    from rlkit.rollout import SamplingParams, build_engine

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_one_rank_group(device)
    fsdp = rlkit.FSDPConfig()
    dtype = param_dtype(fsdp, device.type)
    directory = model_dir(args.shape, args.root)
    tokenizer = load_tokenizer(directory)
    ids, mask = prompts(args.shape, n_prompts, args.prompt_tokens, tokenizer)
    ids, mask = ids.to(device), mask.to(device)
    actor = apply_fsdp(load_causal_lm(directory, dtype=torch.float32, device=device),
                       build_mesh(device.type, 1, fsdp), fsdp)
    params = SamplingParams(n=args.samples, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=0)
    n_params = sum(p.numel() for p in actor.parameters())
    print(f"model {args.shape} ({n_params / 1e6:.1f}M params, {dtype}) on {device}; {n_prompts} prompts x "
          f"{args.samples} samples, prompt {ids.shape[1]} tokens, at most {new_tokens} new tokens", flush=True)
    rows = {}
    for name in args.engines.split(","):
        config = rlkit.RolloutConfig(engine=name, max_new_tokens=new_tokens, engine_logprobs=args.engine_logprobs)
        start = time.perf_counter()
        engine = build_engine(config, directory, device=device, dtype=dtype, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, max_num_seqs=n_prompts * args.samples,
                              max_prompt_tokens=ids.shape[1], seed=0)
        built = time.perf_counter() - start
        try:
            rows[name] = {"start_s": built, **measure(engine, actor, ids, mask, params, args.repeats, device)}
        finally:
            engine.close()
        del engine
        if cuda:
            torch.cuda.empty_cache()  # the next engine (vLLM: another process) needs this memory
        print(f"  {name}: done", flush=True)
    report(rows)
    write_result(args.json, args.label, rows, args)


def report(rows: dict[str, dict]) -> None:
    base = rows.get("hf")
    print(f"\n{'engine':<7}{'start s':>9}{'tokens':>9}{'gen s':>8}{'tok/s':>10}{'x hf':>7}{'gather s':>10}"
          f"{'sync 1 s':>10}{'sync s':>8}{'how':>10}{'sleep s':>9}{'freed GiB':>11}{'woken s':>9}{'tensors':>9}")
    for name, r in rows.items():
        rate = r["tokens"] / r["seconds"]
        ratio = rate / (base["tokens"] / base["seconds"]) if base else float("nan")
        print(f"{name:<7}{r['start_s']:>9.1f}{r['tokens']:>9.0f}{r['seconds']:>8.2f}{rate:>10.0f}{ratio:>7.2f}"
              f"{r['gather_s']:>10.3f}{r['sync_first_s']:>10.3f}{r['sync_s']:>8.3f}{r['how']:>10}"
              f"{r['sleep_s']:>9.2f}{r['freed_gib']:>11.1f}{r['sync_after_sleep_s']:>9.3f}{r['tensors']:>9.0f}")


if __name__ == "__main__":
    main()
