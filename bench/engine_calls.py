"""On rlkit's worker (rank 0), beside rlkit's vLLM engine: bare vLLM on the same rollout, and the engine call taken
apart (``bench/grpo_step.py --bare-vllm``; functions for ``cluster.run``).

:func:`start_bare` builds a :class:`~bare_vllm.BareVLLM` (vLLM's defaults, its own engine process, as rlkit's)
in the worker's process and keeps the step's prompts; :func:`bare_call` times one bare generate, which
grpo_step.py alternates with rlkit's steps (ABBA). :func:`breakdown` then alternates, call by call, the ways
a rollout can be generated (:data:`VARIANTS`):

- ``rlkit``: rlkit's ``engine.generate`` (reseeding, prompt and output tensors, log-probs on
  ``rollout.engine_logprobs`` of the prompts) - what a step's ``generate`` phase times;
- ``engine_mixed``: vLLM's own ``generate`` on rlkit's LLM with the same mix of log-prob and plain rows;
- ``engine_one_group``: the same with log-probs on one prompt's completions only (the least a gap check asks);
- ``engine_plain``: the same, no log-probs;
- ``bare_plain`` and ``bare_mixed``: the bare LLM without and with the mix;
- ``processed_plain`` and ``processed_mixed``: a second bare LLM, built for the breakdown, whose only setting
  of rlkit's is ``logprobs_mode="processed_logprobs"`` (vLLM's sampler then takes a log-softmax of the whole
  batch's logits at every decode step, whether a row asked for log-probs or not).

:data:`CAUSES` pairs them so that each difference between rlkit's generation and bare vLLM is one paired ratio
(:func:`causes`): rlkit's wrapping, the log-prob rows on each engine, the log-prob mode with and without rows,
and the rest of rlkit's engine settings (its memory, sleep mode and worker extension: :func:`settings` lists
every engine setting and sampling field that differs). Each call also records the CPU seconds of this process's
vLLM processes and of this process, and the load average (CPU contention).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from bare_vllm import BareVLLM, engine_settings, sampling_fields, sampling_params, timed_call, vllm_cpu_seconds
from stats import paired_ratio, spread

VARIANTS = ("rlkit", "engine_mixed", "engine_one_group", "engine_plain", "bare_plain", "bare_mixed",
            "processed_plain", "processed_mixed")
CAUSES = {
    "rlkit's wrapping": ("rlkit", "engine_mixed"),
    "log-prob rows, rlkit's engine": ("engine_mixed", "engine_plain"),
    "one group's log-prob rows, rlkit's engine": ("engine_one_group", "engine_plain"),
    "log-prob rows, bare vLLM": ("bare_mixed", "bare_plain"),
    "processed_logprobs, no rows": ("processed_plain", "bare_plain"),
    "processed_logprobs, with the rows": ("processed_mixed", "bare_mixed"),
    "rlkit's other engine settings, no rows": ("engine_plain", "processed_plain"),
    "rlkit's other engine settings, with the rows": ("engine_mixed", "processed_mixed"),
    "rlkit over bare vLLM asked for the same rows": ("rlkit", "bare_mixed"),
    "rlkit over bare vLLM": ("rlkit", "bare_plain"),
}
"""Each cause of the difference: (a variant, the variant that differs from it by that cause alone); the last two
are the totals."""


@dataclass
class Probe:
    """What the worker keeps between calls: the bare engines, the prompts and rlkit's sampling settings."""

    bare: BareVLLM
    prompt_ids: torch.Tensor
    """[N, P] the step's prompts (equal lengths: no padding)."""
    group: int
    response_len: int
    logprob_fraction: float
    make_bare: Callable[..., BareVLLM]
    """Builds another bare engine on the same prompts, lengths and memory (extra keyword arguments of BareVLLM)."""
    processed: BareVLLM | None = None
    """The bare engine in rlkit's ``logprobs_mode``, built by the first :func:`breakdown`."""
    problems: list[str] = field(default_factory=list)
    """Why variants could not run (their engine did not start)."""


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

    def make_bare(**extra) -> BareVLLM:
        return BareVLLM(Path(model_dir), ids, group=group, response_len=response_len, lengths=lengths,
                        gpu_memory_utilization=gpu_memory_utilization, gpu=gpu, sleep_between=gpu is not None, **extra)

    bare = make_bare()
    fraction = policy.config.rollout.engine_logprobs
    context().state["bench.probe"] = Probe(bare, torch.tensor(ids), group, response_len, fraction, make_bare)
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
    if variant.startswith("processed"):
        processed = probe.processed
        assert processed is not None, "breakdown() builds the processed_logprobs engine first"
        fraction = probe.logprob_fraction if variant == "processed_mixed" else 0.0
        return _observed(lambda: processed.generate(fraction))
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
    fraction = {"engine_mixed": probe.logprob_fraction, "engine_one_group": 1 / len(probe.prompt_ids)}.get(variant, 0.0)
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
    """``rounds`` rounds of every variant that can run, the order reversed every other round; each variant's
    spread of seconds and CPU seconds, each cause's paired ratio (:func:`causes`), why a variant could not run,
    and the calls."""
    probe = _probe()
    _start_processed(probe)
    variants = [v for v in VARIANTS if probe.processed is not None or not v.startswith("processed")]
    calls: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else reversed(variants):
            calls[variant].append(engine_call(variant, seed=r))
    return {"variants": {v: {"s": spread([c["s"] for c in cs]), "vllm_cpu_s": spread([c["vllm_cpu_s"] for c in cs]),
                             "worker_cpu_s": spread([c["worker_cpu_s"] for c in cs])} for v, cs in calls.items()},
            "causes": causes({v: [c["s"] for c in cs] for v, cs in calls.items()}), "problems": list(probe.problems),
            "calls": calls}


def causes(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each :data:`CAUSES` entry whose two variants both ran: the paired ratio of their seconds, round by round
    (``seconds``: each variant's seconds, one per round)."""
    return {cause: paired_ratio(seconds[a], seconds[b]) for cause, (a, b) in CAUSES.items()
            if seconds.get(a) and seconds.get(b)}


def _start_processed(probe: Probe) -> None:
    """Build the bare engine in rlkit's log-prob mode, once; a failure to start is recorded, not raised (the other
    variants still run). On GPU this process's cached blocks go back first: that engine checks free memory."""
    if probe.processed is not None or probe.problems:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        probe.processed = probe.make_bare(logprobs_mode="processed_logprobs")
    except Exception as exc:  # noqa: BLE001 - recorded in the breakdown's problems
        probe.problems.append(f"processed_* not run, their engine did not start: {type(exc).__name__}: {exc}")


def settings() -> dict[str, dict[str, object]]:
    """rlkit's engine's and the bare engine's settings side by side, only those that differ: engine settings by
    their vLLM config names, then the fields of their SamplingParams for a plain row as ``sampling.<field>``."""
    from vllm import SamplingParams as VLLMSamplingParams

    from rlkit.rollout import SamplingParams

    probe, engine = _probe(), _policy().engine
    params = SamplingParams(n=probe.group, max_new_tokens=probe.response_len, min_new_tokens=probe.response_len,
                            temperature=1.0, top_p=1.0, seed=0)
    rlkit_sampling = VLLMSamplingParams(**engine._sampling_settings(params))
    mine = engine_settings(engine.llm) | _prefixed(sampling_fields(rlkit_sampling))
    bare = probe.bare.settings() | _prefixed(sampling_fields(sampling_params(probe.group, probe.response_len, False)))
    return differences(mine, bare)


def _prefixed(fields: dict[str, str]) -> dict[str, str]:
    return {f"sampling.{k}": v for k, v in fields.items()}


def differences(mine: dict[str, object], bare: dict[str, object]) -> dict[str, dict[str, object]]:
    """The keys whose values differ between two engines' settings (a key only one of them has included), sorted."""
    return {k: {"rlkit": mine.get(k), "bare": bare.get(k)} for k in sorted(mine.keys() | bare.keys())
            if mine.get(k) != bare.get(k)}


def stop_bare() -> None:
    from rlkit.runtime import context

    probe = context().state.pop("bench.probe", None)
    if probe is not None:
        probe.bare.close()
        if probe.processed is not None:
            probe.processed.close()
