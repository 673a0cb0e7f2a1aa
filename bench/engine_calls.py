"""On rlkit's worker (rank 0), beside rlkit's vLLM engine: bare vLLM on the same rollout, and the engine call taken
apart (``bench/grpo_step.py --bare-vllm``; functions for ``cluster.run``).

:func:`start_bare` builds a :class:`~bare_vllm.BareVLLM` (vLLM's defaults, its own engine process, as rlkit's)
in the worker's process and keeps the step's prompts; :func:`bare_call` times one bare generate, which
grpo_step.py alternates with rlkit's steps (ABBA). :func:`breakdown` then alternates, call by call, the ways
a rollout can be generated, so that the difference between rlkit's generation and bare vLLM splits into:

- ``rlkit``: rlkit's ``engine.generate`` (reseeding, prompt and output tensors, log-probs on
  ``rollout.engine_logprobs`` of the prompts) - what a step's ``generate`` phase times;
- ``engine_mixed``: vLLM's own ``generate`` on rlkit's LLM with the same mix of log-prob and plain rows;
- ``engine_plain``: the same, no log-probs;
- ``bare_plain`` and ``bare_mixed``: the bare LLM without and with the mix.

So rlkit - engine_mixed is rlkit's wrapping, engine_mixed - engine_plain the log-prob rows, engine_plain -
bare_plain the engine's settings (sleep mode's allocator, processed log-probs, the worker extension: see
:func:`settings`). Each call also records the CPU seconds of this process's vLLM processes and of this
process, and the load average (CPU contention).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from bare_vllm import BareVLLM, engine_settings, timed_call, vllm_cpu_seconds
from stats import spread

VARIANTS = ("rlkit", "engine_mixed", "engine_plain", "bare_plain", "bare_mixed")


@dataclass
class Probe:
    """What the worker keeps between calls: the bare engine, the prompts and rlkit's sampling settings."""

    bare: BareVLLM
    prompt_ids: torch.Tensor
    """[N, P] the step's prompts (equal lengths: no padding)."""
    group: int
    response_len: int
    logprob_fraction: float


def _policy():
    from rlkit.runtime import context

    return next(v for v in context().state.values() if hasattr(v, "engine"))


def _probe() -> Probe:
    from rlkit.runtime import context

    return context().state["bench.probe"]


def start_bare(model_dir: str, prompts: list[str], group: int, response_len: int, lengths: list[int] | None,
               gpu_memory_utilization: float) -> dict[str, object]:
    """Build the bare engine on this rank's GPU; returns its start seconds and settings."""
    from rlkit.models import load_tokenizer
    from rlkit.rollout.vllm import visible_gpu_id
    from rlkit.runtime import context

    policy = _policy()
    tokenizer = load_tokenizer(Path(model_dir))
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    gpu = visible_gpu_id(policy.device) if policy.device.type == "cuda" else None
    bare = BareVLLM(Path(model_dir), ids, group=group, response_len=response_len, lengths=lengths,
                    gpu_memory_utilization=gpu_memory_utilization, gpu=gpu, sleep_between=gpu is not None)
    fraction = policy.config.rollout.engine_logprobs
    context().state["bench.probe"] = Probe(bare, torch.tensor(ids), group, response_len, fraction)
    return {"start_s": bare.start_s, "settings": bare.settings()}


def bare_call(mixed: bool = False) -> dict[str, float]:
    """One timed bare generate of the step's rollout (with rlkit's mix of log-prob rows when ``mixed``)."""
    probe = _probe()
    return _observed(lambda: probe.bare.generate(probe.logprob_fraction if mixed else 0.0))


def engine_call(variant: str, seed: int = 0) -> dict[str, float]:
    """One timed call of ``variant`` (:data:`VARIANTS`) on the step's rollout."""
    probe, policy = _probe(), _policy()
    if variant.startswith("bare"):
        return bare_call(mixed=variant == "bare_mixed")
    engine = policy.engine
    engine._wake("weights", "kv_cache")  # a sleeping engine wakes outside the timed call, as in a step
    if variant == "rlkit":
        from rlkit.rollout import SamplingParams

        params = SamplingParams(n=probe.group, max_new_tokens=probe.response_len, min_new_tokens=probe.response_len,
                                temperature=1.0, top_p=1.0, seed=seed)
        ids = probe.prompt_ids.to(policy.device)

        def call():
            start = time.perf_counter()
            gen = engine.generate(ids, torch.ones_like(ids), params)
            return {"s": time.perf_counter() - start, "tokens": int(gen.response_mask.sum())}

        return _observed(call, with_vllm=True)
    fraction = probe.logprob_fraction if variant == "engine_mixed" else 0.0
    return _observed(lambda: timed_call(engine.llm, probe.bare.prompts, probe.group, probe.response_len, fraction))


def _observed(call, with_vllm: bool = False) -> dict[str, float]:
    """``call()``'s figures plus this process's CPU seconds, its vLLM processes' (when ``call`` does not count
    them) and the 1-minute load average."""
    me = psutil.Process()
    mine, vllm = sum(me.cpu_times()[:2]), vllm_cpu_seconds()
    out = call()
    out["worker_cpu_s"] = sum(me.cpu_times()[:2]) - mine
    if with_vllm:
        out["vllm_cpu_s"] = vllm_cpu_seconds() - vllm
    out["load_1min"] = os.getloadavg()[0]
    return out


def breakdown(rounds: int) -> dict[str, object]:
    """``rounds`` rounds of every variant, the order reversed every other round; each variant's spread of
    seconds and CPU seconds, and the calls."""
    calls: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            calls[variant].append(engine_call(variant, seed=r))
    return {"variants": {v: {"s": spread([c["s"] for c in cs]), "vllm_cpu_s": spread([c["vllm_cpu_s"] for c in cs]),
                             "worker_cpu_s": spread([c["worker_cpu_s"] for c in cs])} for v, cs in calls.items()},
            "calls": calls}


def settings() -> dict[str, dict[str, object]]:
    """rlkit's engine's and the bare engine's settings side by side (only those that differ)."""
    mine, bare = engine_settings(_policy().engine.llm), _probe().bare.settings()
    return {k: {"rlkit": mine.get(k), "bare": bare.get(k)} for k in sorted(mine.keys() | bare.keys())
            if mine.get(k) != bare.get(k)}


def stop_bare() -> None:
    from rlkit.runtime import context

    probe = context().state.pop("bench.probe", None)
    if probe is not None:
        probe.bare.close()
