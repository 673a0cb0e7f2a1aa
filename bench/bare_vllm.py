"""Bare vLLM on a GRPO step's rollout: the yardstick rlkit's generation is held to (figures, not a test).

    python bench/bare_vllm.py --shape 0.5b [--prompts 64 --group 8 --prompt-len 64 --response-len 256]
        [--lengths varlen] [--logprob-fraction 0.125] [--warmup 2 --steps 8] [--json PATH]

Same model directory, prompts (as token ids), completions per prompt, lengths, temperature (1) and batch
(``max_num_seqs`` = every completion at once) as ``bench/grpo_step.py``; vLLM's defaults otherwise: no
per-request seed, no detokenising, CUDA graphs on, the engine in its own process (as rlkit's). No
log-probs by default; ``--logprob-fraction`` asks for the sampled tokens' log-probs on that fraction of the
prompts, as rlkit's engine does (``rollout.engine_logprobs``). ``bench/grpo_step.py --bare-vllm`` builds a
:class:`BareVLLM` inside rlkit's worker, beside rlkit's engine, and alternates the two on the same rollout.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
from results import write_result
from shapes import SHAPES
from stats import describe, spread, timed
from workloads import ForcedLengths, build_model_dir, digit_prompts, workload_lengths

DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENGINE_FIELDS = {"scheduler_config": ("async_scheduling", "max_num_seqs", "max_num_batched_tokens",
                                      "enable_chunked_prefill", "policy"),
                 "cache_config": ("gpu_memory_utilization", "num_gpu_blocks", "kv_cache_memory_bytes", "block_size",
                                  "cache_dtype", "enable_prefix_caching", "enable_sleep_mode"),
                 "model_config": ("dtype", "max_model_len", "seed", "logprobs_mode", "max_logprobs", "enforce_eager",
                                  "generation_config", "enable_sleep_mode"),
                 "compilation_config": ("mode", "level", "cudagraph_mode", "max_cudagraph_capture_size",
                                        "cudagraph_capture_sizes"),
                 "parallel_config": ("tensor_parallel_size", "distributed_executor_backend", "worker_extension_cls")}
"""The engine settings :func:`engine_settings` reads (where this vLLM has them), to tell two engines apart: every
argument rlkit's engine passes to ``vllm.LLM`` and those of vLLM's own choosing that decide a decode step's work."""


def sampling_params(group: int, response_len: int, logprobs: bool):
    from vllm import SamplingParams

    extra = {"logprobs": 0, "flat_logprobs": True} if logprobs else {}
    return SamplingParams(n=group, temperature=1.0, max_tokens=response_len, min_tokens=response_len,
                          detokenize=False, **extra)


def mixed_params(prompts: int, group: int, response_len: int, fraction: float) -> list:
    """One SamplingParams per prompt: with log-probs on ``ceil(fraction * prompts)`` evenly spaced prompts (as
    rlkit's ``logprob_prompts`` picks them), plain on the rest."""
    count = min(prompts, math.ceil(round(fraction * prompts, 6)))
    chosen = {i * prompts // count for i in range(count)} if count else set()
    with_lp, plain = sampling_params(group, response_len, True), sampling_params(group, response_len, False)
    return [with_lp if i in chosen else plain for i in range(prompts)]


def sampling_fields(params) -> dict[str, str]:
    """Every field of a ``vllm.SamplingParams`` (a msgspec struct, or a plain object in older vLLMs) as text."""
    names = getattr(type(params), "__struct_fields__", None) or sorted(vars(params))
    return {name: str(getattr(params, name)) for name in names if not name.startswith("_")}


def engine_settings(llm) -> dict[str, object]:
    """The :data:`ENGINE_FIELDS` of ``llm``'s engine (vLLM's config objects; missing ones are skipped)."""
    config = llm.llm_engine.vllm_config
    out: dict[str, object] = {}
    for part, names in ENGINE_FIELDS.items():
        section = getattr(config, part, None)
        for name in names:
            if section is not None and hasattr(section, name):
                out[f"{part}.{name}"] = str(getattr(section, name))
    return out


def vllm_cpu_seconds() -> float:
    """User + system CPU seconds of this process's vLLM children so far (their engine core and workers)."""
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM"):
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total


@contextmanager
def engine_environment(gpu: str | None):
    """What a vLLM engine started here inherits: only ``gpu`` visible (None: as it is) and none of a trainer's
    torch.distributed variables (the engine is a world of its own), as rlkit's engine starts."""
    changes = dict.fromkeys(DISTRIBUTED_VARIABLES) | ({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})
    saved = {k: os.environ.get(k) for k in changes}
    _set_environment(changes)
    try:
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class BareVLLM:
    """``vllm.LLM`` with its defaults on one model directory, timing generate calls on a fixed batch of prompts."""

    def __init__(self, model_dir: Path, prompt_ids: list[list[int]], *, group: int, response_len: int,
                 lengths: list[int] | None = None, gpu_memory_utilization: float = 0.15, gpu: str | None = None,
                 sleep_between: bool = False, logprobs_mode: str | None = None):
        """``sleep_between`` (GPU): the engine frees its memory between calls, woken and put back outside the
        timed call, so that beside rlkit's engine it takes none of the memory rlkit's ``rollout.sleep="auto"``
        decides by (resident, 0.15 of an H200 made that engine sleep and its sync wake it: 0.33 s, not 0.043).
        ``logprobs_mode``: vLLM's (None: its default, "raw_logprobs"); "processed_logprobs" is rlkit's."""
        from vllm import LLM
        from vllm.inputs import TokensPrompt

        self.prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        self.group, self.response_len = group, response_len
        longest = max(lengths) if lengths else response_len
        start = time.perf_counter()
        import torch

        # on a CPU (trying the benches out): fp32 as rlkit's engine there, eager, vLLM's CPU KV cache size
        cpu = {} if torch.cuda.is_available() else {"dtype": "float32", "enforce_eager": True,
                                                    "kv_cache_memory_bytes": 2**30}
        with engine_environment(gpu):
            self.llm = LLM(model=str(model_dir), **{"dtype": "bfloat16", **cpu}, seed=0,
                           max_num_seqs=len(prompt_ids) * group, max_model_len=max(map(len, prompt_ids)) + longest,
                           enable_prefix_caching=False, gpu_memory_utilization=gpu_memory_utilization,
                           generation_config="vllm", **({"enable_sleep_mode": True} if sleep_between else {}),
                           **({"logprobs_mode": logprobs_mode} if logprobs_mode else {}))
        self.start_s = time.perf_counter() - start
        if lengths:
            self.llm.generate = ForcedLengths(self.llm.generate, lengths)
        # warm-up, with log-probs on one prompt: vLLM compiles their rank kernel at its first use (2 s on a CPU),
        # which would otherwise land in the first timed call that asks for log-probs
        self.llm.generate(self.prompts[:2], mixed_params(2, group, response_len, 0.5), use_tqdm=False)
        self.sleep_between = sleep_between
        if sleep_between:
            self.llm.sleep(level=1)

    def generate(self, logprob_fraction: float = 0.0) -> dict[str, float]:
        """One timed call on every prompt (log-probs on ``logprob_fraction`` of them): wall and vLLM CPU seconds.
        With ``sleep_between`` the engine wakes before the timer starts and sleeps after it stops."""
        if self.sleep_between:
            self.llm.wake_up()
        try:
            return timed_call(self.llm, self.prompts, self.group, self.response_len, logprob_fraction)
        finally:
            if self.sleep_between:
                self.llm.sleep(level=1)

    def settings(self) -> dict[str, object]:
        return engine_settings(self.llm)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None


def timed_call(llm, prompts: list, group: int, response_len: int, logprob_fraction: float) -> dict[str, float]:
    """``llm.generate`` on ``prompts`` x ``group`` (log-probs on ``logprob_fraction`` of the prompts), timed."""
    params = mixed_params(len(prompts), group, response_len, logprob_fraction)
    cpu, start = vllm_cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"s": wall, "vllm_cpu_s": vllm_cpu_seconds() - cpu, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, help="256; with --lengths varlen the longest, 2048")
    parser.add_argument("--lengths", choices=("fixed", "varlen"), default="fixed")
    parser.add_argument("--logprob-fraction", type=float, default=0.0, help="prompts whose completions get log-probs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="bare-vllm")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = workload_lengths(args, args.prompts * args.group)
    model_dir = build_model_dir(args.shape, args.root)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(p)["input_ids"] for p in digit_prompts(args.prompts, args.prompt_len)]
    bare = BareVLLM(model_dir, ids, group=args.group, response_len=args.response_len, lengths=lengths)
    calls = [bare.generate(args.logprob_fraction) for _ in range(args.warmup + args.steps)]
    settings = bare.settings()
    bare.close()
    times = timed([c["s"] for c in calls], args.warmup)
    figures = {"generate": spread(times), "generate_s": spread(times)["median"], "calls": calls,
               "tokens_per_s": calls[-1]["tokens"] / spread(times)["median"], "start_s": bare.start_s,
               "engine_settings": settings}
    print(f"bare vLLM: {args.shape}, {args.prompts}x{args.group} completions ({args.lengths}), log-probs on "
          f"{args.logprob_fraction:.3g} of the prompts: generate {describe(figures['generate'])}, "
          f"{figures['tokens_per_s']:.0f} tokens/s, start {bare.start_s:.1f} s")
    print(f"  engine settings: {settings}")
    write_result(args.json, args.label, figures, args)


if __name__ == "__main__":
    main()
