"""Preflight memory estimate: an rlkit run's per-rank device peak, from the model's config and the settings alone.

No cluster, no weights::

    est = estimate_memory("/models/qwen2.5-3b", world_size=1, device_memory_gib=139.8, prompt_tokens=64,
                          response_tokens=1024, samples_per_step=128, micro_batch_size=16)
    est.to_pandas()       # GiB per term (rows) and phase (columns); est.peak_phase, est.peak_gib, est.fits
    est.fixes             # when it does not fit: the changes that help, cheapest first, each with its new peak
    est.compare(128.8)    # beside a measured torch.cuda.max_memory_allocated (GiB)

Phases: "rollout" (generation; the actor's state stays resident), "scoring" (no-grad log-prob / reference /
value passes), "update" (the actor's loss: every saved activation plus the logits), "backward" (the decoder
layers' backward: with activation checkpointing, one layer's recompute), "optimizer_step" and "weight_sync".
The critic's own update saves the same layer activations without the logits, so it never exceeds "update".
Lengths are taken at their maxima (prompt_tokens + response_tokens per row): a worst case, and exactly the
benchmarks' fixed-length workload. The terms live in :mod:`rlkit.diagnostics.memory_terms`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from rlkit.diagnostics.memory_terms import (
    CUDA_CONTEXT_GIB,
    DTYPE_BYTES,
    FRAGMENTATION,
    GiB,
    MemorySetting,
    ModelShape,
    activation_bytes,
    engine_bytes,
    gathered_bytes,
    generate_bytes,
    head_bytes,
    host_offload_bytes,
    shared_weights_bytes,
    state_bytes,
    sync_bytes,
    trained_params,
    update_gradient_bytes,
)
from rlkit.rollout.sleep import AWAKE_HEADROOM

TERMS = ("parameters", "gradients", "optimizer", "activations", "logits", "gathered", "engine", "rest")
"""Rows of the estimate: FSDP's fp32 shards and AdamW state, saved activations, the LM head's logits and
log-softmax chunks, "gathered" compute-dtype weights in the trainer's process (FSDP units in flight, vLLM's
weight-sync buffers), the rollout engine (vLLM's in its own process), and the rest (the CUDA context and
allocator fragmentation: :data:`CUDA_CONTEXT_GIB` + :data:`FRAGMENTATION` of the allocated total)."""

TOLERANCE = 0.15
"""How far a measured peak may sit from the prediction and still count as agreeing (issue 15's acceptance)."""
MARGIN = 0.05
"""A peak that fits within this fraction of the device is tight: measured/predicted on one H200 ran 0.95-1.02 at
0.5B and 3B (2026-12-04), and 7B with CPU offload, estimated at 97.5% of the device, ran out of memory."""

HOST_HEADROOM = 0.10
"""The share of a host's memory left to the OS, the ranks' Python and CUDA runtimes and pinned transfer buffers:
what the offloaded state and sleeping engines may not take (7B full fine-tuning offloaded 113.5 GiB beside a
14.2 GiB sleeping engine on a 128 GiB H200 host, and the OS killed the rank in its first update, 2026-12-04)."""

MARK_PHASES = {"rollout": "rollout", "actor_logprobs": "scoring", "reference": "scoring",
               "forward_backward": "update", "optimizer_step": "optimizer_step", "weight_sync": "weight_sync"}
"""rlkit's memory marks (``trainer.memory()``'s phase column) and the estimate phase each one measures; the
forward_backward mark spans the estimate's "update" and "backward"."""

MAX_RANKS = 1024
"""The "more ranks" fix looks at world sizes doubling up to this."""


class Fix(NamedTuple):
    """One change that lowers the predicted peak: the setting, its new value and the peak with it (GiB)."""

    setting: str
    value: Any
    peak_gib: float
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """The predicted per-rank device memory of each phase (GiB by term), the peak, and the fixes if it does not fit."""

    shape: ModelShape
    setting: MemorySetting
    phases: dict[str, dict[str, float]]
    """GiB by term (:data:`TERMS`) for each phase that the setting runs."""
    fixes: list[Fix] = field(default_factory=list)
    """Empty when the peak fits with room; else each change that lowers it, cheapest first (see :func:`fixes_for`)."""
    keep_unsharded: bool = False
    """Whether the update keeps FSDP's units gathered through an optimizer step's micro-batches (the setting's
    ``keep_unsharded``, resolved: when None, kept where the step then leaves AWAKE_HEADROOM of the device free)."""
    engine_awake: bool = False
    """Whether vLLM stays awake through scoring and the update (``engine_sleep``, resolved: "auto" stays awake
    where the whole step then leaves AWAKE_HEADROOM of the device free)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_gib(self) -> float:
        return sum(self.phases[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.setting.device_memory_gib

    @property
    def tight(self) -> bool:
        """It fits, but within :data:`MARGIN` of the device: within the estimate's own error."""
        return self.fits and self.peak_gib > (1 - MARGIN) * self.setting.device_memory_gib

    @property
    def host_gib(self) -> dict[str, float]:
        """Host memory of one host's ranks (GiB) by what holds it (:func:`host_offload_bytes`)."""
        return {k: v / GiB for k, v in host_offload_bytes(self.shape, self.setting).items()}

    @property
    def host_fits(self) -> bool:
        """What the host holds stays within (1 - :data:`HOST_HEADROOM`) of its memory (True where not checked)."""
        total = self.setting.host_memory_gib
        return not total or sum(self.host_gib.values()) <= (1 - HOST_HEADROOM) * total

    @property
    def engine_line(self) -> str | None:
        """Whether vLLM stays awake through the update under ``rollout.sleep="auto"``, and why (None otherwise)."""
        s = self.setting
        if s.engine != "vllm" or s.engine_sleep != "auto":
            return None
        room = (1 - AWAKE_HEADROOM) * s.device_memory_gib
        peak = _estimate(self.shape, dataclasses.replace(s, engine_sleep="never")).peak_gib
        if self.engine_awake:
            return f"vLLM stays awake through the update (with it awake, peak {peak:.1f} GiB <= {room:.1f})"
        return (f"vLLM sleeps through the update (awake, the peak would be {peak:.1f} GiB > {room:.1f}, "
                f"{AWAKE_HEADROOM:.0%} of the device kept spare)")

    @property
    def trainer_bytes(self) -> int:
        """What the trainer's process reserves at its peak after the rollout (scoring, the update, the optimizer
        step): the allocated peak with the allocator's fragmentation; what "auto" sleep weighs the engine against."""
        phases = [p for p in ("scoring", "update", "backward", "optimizer_step") if p in self.phases]
        return int(max(self.allocated_gib(p) for p in phases) * (1 + FRAGMENTATION) * GiB)

    def allocated_gib(self, phase: str | None = None) -> float:
        """What ``torch.cuda.max_memory_allocated`` in the trainer's process should read at ``phase`` (default:
        the peak): the total less the rest (context, fragmentation) and less a vLLM engine (its own process)."""
        terms = self.phases[phase or self.peak_phase]
        engine = terms["engine"] if self.setting.engine == "vllm" else 0.0
        return sum(terms.values()) - terms["rest"] - engine

    def to_pandas(self) -> pd.DataFrame:
        """GiB with one row per term plus "total", one column per phase."""
        table = pd.DataFrame(self.phases).reindex(list(TERMS))
        table.loc["total"] = table.sum()
        return table

    def compare(self, measured_gib: float, phase: str | None = None) -> pd.DataFrame:
        """One row: the predicted allocated peak (:meth:`allocated_gib`) beside a measured one, their ratio and
        whether they agree within :data:`TOLERANCE`. ``measured_gib``: torch.cuda.max_memory_allocated / 2**30."""
        phase = phase or self.peak_phase
        return pd.DataFrame([_agreement(phase, self.allocated_gib(phase), measured_gib)])

    def compare_marks(self, marks: pd.DataFrame) -> pd.DataFrame:
        """:meth:`compare` for each phase that rlkit's memory marks measure: ``marks`` is ``trainer.memory()``
        (one row per rank and mark, peak_mb since the previous mark); the largest over ranks counts."""
        rows = []
        for phase in dict.fromkeys(MARK_PHASES.values()):
            measured = marks.loc[marks["phase"].map(MARK_PHASES) == phase, "peak_mb"]
            if phase in self.phases and len(measured):
                spanned = [p for p in (phase, "backward") if p == phase or phase == "update"]
                predicted = max(self.allocated_gib(p) for p in spanned)
                rows.append(_agreement(phase, predicted, float(measured.max()) / 1024))
        return pd.DataFrame(rows)

    def __str__(self) -> str:
        s = self.setting
        verdict = ("fits, tightly" if self.tight else "fits") if self.fits else "DOES NOT FIT"
        head = (f"memory estimate: {self.shape.num_parameters / 1e6:,.1f}M parameters, {s.world_size} rank(s), "
                f"{s.tokens_per_micro_batch:,} tokens per micro-batch; peak {self.peak_gib:.1f} GiB per rank in "
                f"{self.peak_phase!r} on a {s.device_memory_gib:.1f} GiB device: {verdict}")
        if self.keep_unsharded:
            head += f"; FSDP units kept gathered through the {s.micro_batches_per_step} micro-batches of a step"
        lines = [head] + ([self.engine_line] if self.engine_line else []) + [self.to_pandas().round(2).to_string()]
        lines += [f"  fix: {f}" for f in self.fixes]
        return "\n".join(lines)


def phase_bytes(shape: ModelShape, s: MemorySetting) -> dict[str, dict[str, int]]:
    """Bytes by term (the terms of :mod:`rlkit.diagnostics.memory_terms`) for each phase the setting runs.
    The optimizer step adds foreach AdamW's one fp32 temporary the size of the actor's shard."""
    e = DTYPE_BYTES[s.compute_dtype]
    state = state_bytes(shape, s)
    awake = s.engine_sleep == "never"  # "auto" is resolved by the caller into "never" or "always"
    engine, shared = engine_bytes(shape, s, awake=awake), shared_weights_bytes(shape, s, awake=awake)
    forward, backward = (gathered_bytes(shape, s, e, backward=b) + shared for b in (False, True))
    phases = {"rollout": {**state, "engine": engine_bytes(shape, s, awake=True), **generate_bytes(shape, s),
                          "gathered": shared_weights_bytes(shape, s, awake=True)}}
    if s.recompute_logprobs or s.reference or s.critic:
        scores_logits = s.recompute_logprobs or s.reference
        # scoring runs outside the update's accumulation: its units are gathered one at a time even when the
        # update keeps them all
        resharding = gathered_bytes(shape, dataclasses.replace(s, keep_unsharded=False), e, backward=False) + shared
        phases["scoring"] = {
            **state, "engine": engine, "gathered": resharding,
            "activations": activation_bytes(shape, s, e, phase="scoring"),
            "logits": head_bytes(shape, s, e, grad=False) if scores_logits else 0,
        }
    # keep_unsharded: the actor's sharded gradients are None through the micro-batches (set so at the mini-batch's
    # start, written by the last one's reduce-scatter as its unsharded ones, counted in "gathered", go)
    sharded_grads = 4 * trained_params(shape, s) // s.shard_size if s.keep_unsharded else 0
    accumulating = {**state, "gradients": state["gradients"] - sharded_grads}
    phases["update"] = {
        **state, "gradients": update_gradient_bytes(shape, s), "engine": engine, "gathered": forward,
        "activations": activation_bytes(shape, s, e, phase="update"),
        "logits": head_bytes(shape, s, e, grad=True),
    }
    phases["backward"] = {
        **accumulating, "engine": engine, "gathered": backward,
        "activations": activation_bytes(shape, s, e, phase="backward"),
    }
    step = 0 if s.cpu_offload else 4 * trained_params(shape, s) // s.shard_size
    phases["optimizer_step"] = {**state, "engine": engine, "gathered": shared, "optimizer": state["optimizer"] + step}
    phases["weight_sync"] = {**state, **sync_bytes(shape, s)}
    return phases


def _agreement(phase: str, predicted: float, measured: float) -> dict[str, Any]:
    ratio = measured / predicted
    return {"phase": phase, "predicted_gib": round(predicted, 2), "measured_gib": round(measured, 2),
            "measured/predicted": round(ratio, 3), f"within {TOLERANCE:.0%}": abs(ratio - 1) <= TOLERANCE}


def model_shape(model_config: ModelShape | Mapping | str | Path | Any) -> ModelShape:
    """A :class:`ModelShape` from a local model directory ("tiny": the bundled model), a config.json dict,
    a transformers PretrainedConfig, or a ModelShape."""
    if isinstance(model_config, ModelShape):
        return model_config
    if isinstance(model_config, str | Path):
        from rlkit.models.loading import resolve_model_dir

        with open(resolve_model_dir(str(model_config)) / "config.json") as f:
            model_config = json.load(f)
    return ModelShape.from_config(model_config)


def estimate_memory(model_config: ModelShape | Mapping | str | Path | Any, setting: MemorySetting | None = None,
                    **knobs: Any) -> MemoryEstimate:
    """Predict each phase's per-rank device memory for ``model_config`` (see :func:`model_shape`) under
    ``setting`` (fields of :class:`MemorySetting`; ``knobs`` override them, e.g. ``estimate_memory(cfg,
    world_size=2, device_memory_gib=79.6, activation_checkpointing=True)``), with the fixes if it does not fit."""
    shape = model_shape(model_config)
    if setting is None:
        setting = MemorySetting(**knobs)
    elif knobs:
        setting = dataclasses.replace(setting, **knobs)
    est = _estimate(shape, setting)
    return est if est.fits and not est.tight else dataclasses.replace(est, fixes=fixes_for(est))


def _estimate(shape: ModelShape, setting: MemorySetting) -> MemoryEstimate:
    """The phases of ``setting``; rollout.sleep="auto" keeps vLLM awake when the whole step then leaves
    AWAKE_HEADROOM of the device free (as rlkit.rollout.sleep.SleepPolicy decides), else it sleeps; with that
    engine, ``keep_unsharded=None`` keeps the units gathered through the micro-batches when the step then
    leaves AWAKE_HEADROOM free too (how rlkit.workers.policy decides)."""
    room = (1 - AWAKE_HEADROOM) * setting.device_memory_gib
    if setting.engine == "vllm" and setting.engine_sleep == "auto":
        awake = _estimate(shape, dataclasses.replace(setting, engine_sleep="never"))
        stays = awake.peak_gib <= room
        chosen = awake if stays else _estimate(shape, dataclasses.replace(setting, engine_sleep="always"))
        return dataclasses.replace(chosen, setting=setting, engine_awake=stays)
    if setting.keep_unsharded is None:
        kept = _estimate(shape, dataclasses.replace(setting, keep_unsharded=setting.can_keep_unsharded))
        keep = kept.keep_unsharded and kept.peak_gib <= room
        chosen = kept if keep else _estimate(shape, dataclasses.replace(setting, keep_unsharded=False))
        return dataclasses.replace(chosen, setting=setting)
    phases = {}
    for phase, terms in phase_bytes(shape, setting).items():
        gib = {k: terms.get(k, 0) / GiB for k in TERMS if k != "rest"}
        in_process = sum(gib.values()) - (gib["engine"] if setting.engine == "vllm" else 0.0)
        gib["rest"] = CUDA_CONTEXT_GIB + FRAGMENTATION * in_process
        phases[phase] = gib
    never_sleeps = setting.engine == "vllm" and setting.engine_sleep == "never"
    return MemoryEstimate(shape=shape, setting=setting, phases=phases, keep_unsharded=bool(setting.keep_unsharded),
                          engine_awake=never_sleeps)


def _with(est: MemoryEstimate, **changes: Any) -> MemoryEstimate:
    return _estimate(est.shape, dataclasses.replace(est.setting, **changes))


def _verdict(peak: float, est: MemoryEstimate) -> str:
    enough = "fits" if peak <= est.setting.device_memory_gib else "not enough alone"
    return f"peak {est.peak_gib:.1f} -> {peak:.1f} GiB, {enough}"


def fixes_for(est: MemoryEstimate) -> list[Fix]:
    """The changes that lower ``est``'s peak, in order of cost: activation checkpointing (about a third more
    update compute), a token budget per micro-batch (more, smaller micro-batches), CPU offload (a slower update),
    more ranks (more hardware), then the rollout engine's memory (when it is what peaks or stays resident)."""
    found = [_checkpointing(est), _micro_batch(est), _offload(est), _more_ranks(est), *_engine_fixes(est)]
    return [f for f in found if f is not None and f.peak_gib < est.peak_gib]


def _checkpointing(est: MemoryEstimate) -> Fix | None:
    if est.setting.activation_checkpointing:
        return None
    peak = _with(est, activation_checkpointing=True).peak_gib
    return Fix("fsdp.activation_checkpointing", True, peak,
               f"turn on fsdp.activation_checkpointing ({_verdict(peak, est)})")


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [low, high] with fits(n), for fits true up to some n and false above; None if none."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _micro_batch(est: MemoryEstimate) -> Fix | None:
    """Smaller micro-batches: packed, the largest ``max_tokens_per_micro_batch`` that fits; padded, the largest
    ``micro_batch_size`` (a token budget counts real tokens, which does not bound a padded micro-batch)."""
    s = est.setting
    seq, device = s.sequence_tokens, s.device_memory_gib
    if s.padding_free:
        budget = _largest(seq, s.tokens_per_micro_batch - 1,
                          lambda n: _with(est, max_tokens_per_micro_batch=n).peak_gib <= device)
        if budget is None:
            return None
        peak = _with(est, max_tokens_per_micro_batch=budget).peak_gib
        return Fix("max_tokens_per_micro_batch", budget, peak,
                   f"max_tokens_per_micro_batch <= {budget:,} ({_verdict(peak, est)})")
    rows = _largest(1, s.tokens_per_micro_batch // seq - 1,
                    lambda n: _with(est, micro_batch_size=n, max_tokens_per_micro_batch=0).peak_gib <= device)
    if rows is None:
        return None
    peak = _with(est, micro_batch_size=rows, max_tokens_per_micro_batch=0).peak_gib
    return Fix("micro_batch_size", rows, peak,
               f"micro_batch_size <= {rows} rows of {seq} tokens, with max_tokens_per_micro_batch=0 "
               f"({_verdict(peak, est)}; with padding_free, max_tokens_per_micro_batch <= {rows * seq:,})")


def _offload(est: MemoryEstimate) -> Fix | None:
    if est.setting.cpu_offload:
        return None
    offloaded = _with(est, cpu_offload=True)
    peak = offloaded.peak_gib
    moved = sum(est.phases[est.peak_phase][k] for k in ("parameters", "gradients", "optimizer"))
    return Fix("fsdp.cpu_offload", True, peak,
               f"fsdp.cpu_offload=True ({_verdict(peak, est)}; {moved:.1f} GiB of parameters, gradients and "
               "optimizer state per rank move to host memory, and the update slows down)")


def _more_ranks(est: MemoryEstimate) -> Fix | None:
    s = est.setting
    if s.sharding == "no_shard":
        if s.world_size < 2:
            return None
        peak = _with(est, sharding="full").peak_gib
        return Fix("fsdp.sharding", "full", peak,
                   f'fsdp.sharding="full" over the {s.world_size} ranks ({_verdict(peak, est)})')
    world, peak = s.world_size, est.peak_gib
    while world < MAX_RANKS and peak > s.device_memory_gib:
        world *= 2
        group = world if s.sharding == "hybrid" else 0
        peak = _with(est, world_size=world, hybrid_shard_size=group).peak_gib
    if world == s.world_size:
        return None
    where = f" (hybrid_shard_size={world})" if s.sharding == "hybrid" else ""
    return Fix("world_size", world, peak, f"more ranks: {world} ranks{where}: {peak:.1f} GiB each "
               f"({'fits' if peak <= s.device_memory_gib else 'not enough alone'})")


def _engine_fixes(est: MemoryEstimate) -> list[Fix | None]:
    s = est.setting
    if s.engine == "hf":
        if est.peak_phase == "rollout":
            return []
        peak = _with(est, engine="vllm", engine_sleep="always").peak_gib
        return [Fix("rollout.engine", "vllm", peak, f'rollout.engine="vllm", which sleeps through the update '
                    f"where the hf engine keeps a whole copy ({_verdict(peak, est)})")]
    found: list[Fix | None] = []
    if s.engine_sleep == "never" and est.peak_phase != "rollout":
        peak = _with(est, engine_sleep="always").peak_gib
        found.append(Fix("rollout.sleep", "always", peak, f'rollout.sleep="always" ({_verdict(peak, est)})'))
    if est.peak_phase == "rollout" and s.kv_cache_gib == 0:
        over = est.peak_gib - s.device_memory_gib
        util = round(s.gpu_memory_utilization - over / s.device_memory_gib - 0.005, 2)
        if util > 0:
            peak = _with(est, gpu_memory_utilization=util).peak_gib
            found.append(Fix("rollout.gpu_memory_utilization", util, peak,
                             f"lower rollout.gpu_memory_utilization to {util} ({_verdict(peak, est)})"))
    return found
