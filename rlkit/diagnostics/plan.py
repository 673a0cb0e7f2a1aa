"""The run's memory plan: the settings a user left unset, chosen from the memory estimate before anything launches.

A GRPO/PPO config leaves four memory settings unset by default (None): ``rollout.gpu_memory_utilization``,
``fsdp.compile``, ``fsdp.activation_checkpointing`` and ``fsdp.cpu_offload``; ``max_tokens_per_micro_batch`` is
unset at 0. :func:`plan_run` fills them in, on a GPU cluster of ``device_memory_gib`` per device:

1. vLLM's KV cache is sized to the rollout (:func:`rollout_kv_gib`): every completion of a rank's step at its
   longest, plus :data:`KV_HEADROOM`, instead of a fixed share of the device.
2. ``fsdp.compile`` is on for full fine-tuning with FSDP2 (:func:`compile_choice` says why, and where not).
3. If the estimate's peak does not fit with :data:`~rlkit.diagnostics.estimate.MARGIN` to spare: the cheapest of
   a token budget per micro-batch (packed rows), then activation checkpointing, then CPU offload, each tried with
   the ones before it, the first that fits.

A setting the user gave is never changed. A run that fits no plan raises ConfigError with the estimate's fixes.
On CPU nothing is sized: the unset switches are off. The chosen settings and why are :attr:`MemoryPlan.line`.

    plan = plan_run(cfg, "/models/qwen2.5-1.5b", world_size=1, device_memory_gib=79.2)
    plan.line          # "memory plan for a 79.2 GiB device: rollout.kv_cache_gb=5.6 (...); ..."
    plan.config        # the config the workers run
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rlkit.config import ConfigError, RLConfig
from rlkit.diagnostics.estimate import MARGIN, MemoryEstimate, model_shape
from rlkit.diagnostics.memory_terms import DTYPE_BYTES, VLLM_WORKSPACE_GIB, GiB, ModelShape
from rlkit.diagnostics.preflight import estimate_for

KV_HEADROOM = 0.25
"""KV cache beyond every completion of a step at its longest, in vLLM's blocks: a refill or a longer multi-turn
context never waits for a free block."""
KV_BLOCK_TOKENS = 16
"""vLLM's KV block: a sequence takes whole blocks."""
ENGINE_SHARE_SLACK = 0.02
"""The share of the device vLLM is told it may use, beyond the estimate of its weights, KV cache and workspace (its
start-up check wants that much free; the KV cache itself is the size given)."""


class PlannedSetting(NamedTuple):
    """One planned setting: its dotted name, the value chosen and why."""

    setting: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value} ({self.reason})"


@dataclass(frozen=True)
class MemoryPlan:
    """The config a run launches with (``config``), what was chosen for it (``choices``) and its estimate (None on
    CPU, where nothing is sized)."""

    config: RLConfig
    choices: tuple[PlannedSetting, ...]
    estimate: MemoryEstimate | None

    @property
    def line(self) -> str:
        """One line: the settings chosen and why, and whether vLLM stays awake through the update."""
        if self.estimate is None:
            return "memory plan: CPU cluster, nothing sized; " + "; ".join(map(str, self.choices))
        est = self.estimate
        head = (f"memory plan for a {est.setting.device_memory_gib:.1f} GiB device: peak {est.peak_gib:.1f} GiB in "
                f"{est.peak_phase!r}")
        parts = [head, *map(str, self.choices)]
        if (awake := est.engine_line) is not None:
            parts.append(awake)
        return "; ".join(parts)


def rollout_kv_gib(config: RLConfig, shape: ModelShape, world_size: int) -> float:
    """The KV cache of one vLLM engine for a step's rollout (GiB): the completions of the ranks it serves
    (``samples_per_step / world_size`` each, ``rollout.tensor_parallel_size`` ranks), each at its longest
    (``max_prompt_tokens + max_new_tokens``, in whole blocks), in the compute dtype, split over the engine's devices,
    with :data:`KV_HEADROOM`."""
    tp = config.rollout.tensor_parallel_size
    rows = config.samples_per_step // world_size * tp
    blocks = math.ceil((config.data.max_prompt_tokens + config.rollout.max_new_tokens) / KV_BLOCK_TOKENS)
    per_token = 2 * shape.num_layers * shape.kv_dim * DTYPE_BYTES[_compute_dtype(config)] / tp
    return (1 + KV_HEADROOM) * rows * blocks * KV_BLOCK_TOKENS * per_token / GiB


def compile_choice(config: RLConfig, device: str) -> PlannedSetting:
    """``fsdp.compile`` when unset: on for full fine-tuning with FSDP2 on GPUs (docs/BENCHMARKS.md: the 0.5B
    update 1.38 s against 1.82 s eager, the 1.5B 3.11 against 4.00, the same loss); off on CPU (compiling costs
    more than it saves at the sizes a CPU trains), with FSDP1 (rlkit compiles FSDP2's layers only) and with LoRA
    (compiled, it ran on an H100; its speed against eager is not measured yet: bench/speed_session.sh d9)."""
    if device != "cuda":
        return PlannedSetting("fsdp.compile", False, "CPU: compiling costs more than it saves here")
    if config.fsdp.version == 1:
        return PlannedSetting("fsdp.compile", False, "FSDP1: rlkit compiles FSDP2's layers only")
    if config.lora.rank > 0:
        return PlannedSetting("fsdp.compile", False, "LoRA: not yet measured faster compiled")
    return PlannedSetting("fsdp.compile", True, "FSDP2 on GPUs: measured faster, same loss")


def plan_run(
    config: RLConfig,
    model_config: ModelShape | Mapping | str | Path | Any = None,
    *,
    world_size: int,
    device: str,
    device_memory_gib: float = 0.0,
    host_memory_gib: float = 0.0,
    ranks_per_host: int = 0,
) -> MemoryPlan:
    """The settings ``config`` left unset, chosen for ``world_size`` ranks on ``device`` ("cpu" or "cuda", each
    GPU of ``device_memory_gib``); ``model_config`` as :func:`~rlkit.diagnostics.estimate_for` (None: the
    config's model). Raises ConfigError, naming the fixes, when no plan fits."""
    if device != "cuda":
        return _plan_cpu(config)
    shape = model_shape(config.model if model_config is None else model_config)
    choices = _engine_choices(config, shape, world_size, device_memory_gib) + _compile(config, "cuda")
    base = _with(config, choices)

    def estimate(candidate: RLConfig) -> MemoryEstimate:
        return estimate_for(candidate, shape, world_size=world_size, device_memory_gib=device_memory_gib,
                            host_memory_gib=host_memory_gib, ranks_per_host=ranks_per_host)  # fmt: skip

    for extra in _escalations(config):
        candidate = _with(base, extra)
        est = estimate(candidate)
        if not _fits(est) and _budget_unset(config):
            budget = _largest_budget(candidate, estimate)
            if budget is not None:
                extra = [*extra, PlannedSetting("max_tokens_per_micro_batch", budget, "the largest budget that fits")]
                candidate = _with(base, extra)
                est = estimate(candidate)
        if _fits(est):
            return MemoryPlan(_with(candidate, _off(candidate)), tuple(choices + extra), est)
    raise ConfigError([_refusal(estimate(_with(base, _escalations(config)[-1])))])


def _plan_cpu(config: RLConfig) -> MemoryPlan:
    choices = _compile(config, "cpu")
    return MemoryPlan(_with(config, [*choices, *_off(config)]), tuple(choices), None)


def _engine_choices(config: RLConfig, shape: ModelShape, world_size: int, device_gib: float) -> list[PlannedSetting]:
    """vLLM's KV cache and nominal share of the device, sized to the rollout, where the user gave neither."""
    rollout = config.rollout
    if rollout.engine != "vllm" or rollout.gpu_memory_utilization is not None or rollout.kv_cache_gb > 0:
        return []
    kv = math.ceil(rollout_kv_gib(config, shape, world_size) * 100) / 100
    weights = shape.num_parameters * DTYPE_BYTES[_compute_dtype(config)] / rollout.tensor_parallel_size / GiB
    share = min(1.0, math.ceil(100 * ((weights + kv + VLLM_WORKSPACE_GIB) / device_gib + ENGINE_SHARE_SLACK)) / 100)
    rows = config.samples_per_step // world_size * rollout.tensor_parallel_size
    tokens = config.data.max_prompt_tokens + rollout.max_new_tokens
    return [PlannedSetting("rollout.kv_cache_gb", kv, f"{rows} completions x {tokens} tokens + {KV_HEADROOM:.0%}"),
            PlannedSetting("rollout.gpu_memory_utilization", share, "the engine's weights, KV cache and workspace")]


def _compile(config: RLConfig, device: str) -> list[PlannedSetting]:
    return [compile_choice(config, device)] if config.fsdp.compile is None else []


def _escalations(config: RLConfig) -> list[list[PlannedSetting]]:
    """The plans tried in order, each adding a slower way to save memory to the ones before (only unset ones)."""
    fsdp = config.fsdp
    steps = [PlannedSetting("fsdp.activation_checkpointing", True, "the update does not fit otherwise")] * (
        fsdp.activation_checkpointing is None)
    steps += [PlannedSetting("fsdp.cpu_offload", True, "the run does not fit otherwise")] * (fsdp.cpu_offload is None)
    return [steps[:n] for n in range(len(steps) + 1)]


def _off(config: RLConfig) -> list[PlannedSetting]:
    """The switches still unset once a plan fits: off (no reason to show)."""
    fsdp = config.fsdp
    names = [n for n in ("activation_checkpointing", "cpu_offload") if getattr(fsdp, n) is None]
    return [PlannedSetting(f"fsdp.{n}", False, "") for n in names]


def _budget_unset(config: RLConfig) -> bool:
    return config.padding_free and config.max_tokens_per_micro_batch == 0


def _largest_budget(config: RLConfig, estimate: Any) -> int | None:
    """The largest ``max_tokens_per_micro_batch`` (at least one row at its longest) with which ``config`` fits."""
    longest = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    low, high = longest, config.samples_per_step * longest
    if not _fits(estimate(dataclasses.replace(config, max_tokens_per_micro_batch=low))):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        fits = _fits(estimate(dataclasses.replace(config, max_tokens_per_micro_batch=mid)))
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def _fits(est: MemoryEstimate) -> bool:
    return est.fits and not est.tight and est.host_fits


def _refusal(planned: MemoryEstimate) -> str:
    """Why no plan fits, with the fixes left (``planned``: the estimate with every planned saving on)."""
    s = planned.setting
    where = (f"peak {planned.peak_gib:.1f} GiB in {planned.peak_phase!r} against the device's "
             f"{s.device_memory_gib:.1f} GiB (less {MARGIN:.0%} kept spare)")
    if not planned.host_fits:
        held = sum(planned.host_gib.values())
        where += (f"; the host would hold {held:.1f} GiB of its {s.host_memory_gib:.1f} GiB (offloaded state, "
                  "sleeping engines)")
    fixes = "; ".join(str(f) for f in planned.fixes if f.peak_gib <= (1 - MARGIN) * s.device_memory_gib)
    return (f"this run does not fit however its unset memory settings are planned, with every planned saving on: "
            f"{where}; " + (f"fixes: {fixes}" if fixes else "use more ranks, a smaller model or shorter sequences"))


def _with(config: RLConfig, choices: list[PlannedSetting]) -> RLConfig:
    """``config`` with the chosen settings set (dotted names: one level of section)."""
    for choice in choices:
        section, _, name = choice.setting.rpartition(".")
        if section:
            table = dataclasses.replace(getattr(config, section), **{name: choice.value})
            config = dataclasses.replace(config, **{section: table})
        else:
            config = dataclasses.replace(config, **{name: choice.value})
    return config


def _compute_dtype(config: RLConfig) -> str:
    return "fp32" if config.fsdp.param_dtype == "fp32" else "bf16"
