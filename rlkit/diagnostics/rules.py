"""The lint rules: each takes one rank's report (``PER_RANK``), all of them (``ACROSS_RANKS``) or, before launch,
a memory estimate (``PREFLIGHT``) and yields Raws."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from rlkit.diagnostics.agreement import outliers
from rlkit.diagnostics.estimate import HOST_HEADROOM
from rlkit.diagnostics.inspection import RankReport
from rlkit.diagnostics.layout import unit_label
from rlkit.diagnostics.scaling import rank_state_bytes, whole_state_bytes

if TYPE_CHECKING:
    from rlkit.diagnostics.estimate import MemoryEstimate


class Raw(NamedTuple):
    id: str
    severity: str
    message: str
    evidence: str
    fix: str
    ranks: tuple[int, ...] = ()


def _listing(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _size(n: float) -> str:
    """Bytes for people: 512 B, 7.5 KiB, 66 MiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def optimizer_before_wrap(r: RankReport) -> Iterator[Raw]:
    opt = r.optimizer
    if opt is None:
        return
    if opt.foreign:
        shapes = [f"{list(t.shape)} {t.dtype}" for t in opt.foreign]
        yield Raw(
            "optimizer-before-wrap", "error",
            f"The optimizer steps {len(opt.foreign)} tensors that are not parameters of the model: it was built "
            "before FSDP wrapped the model, so optimizer.step() updates copies that the model never reads.",
            f"tensors the model does not own: {_listing(shapes)}; trainable model parameters in no optimizer "
            f"group: {len(opt.missing)} ({_listing(opt.missing, 3)})",
            "Build the optimizer after wrapping: fully_shard(...) / FSDP(...) first, then "
            "torch.optim.AdamW(model.parameters(), ...).",
        )
    elif opt.missing:
        yield Raw(
            "optimizer-misses-params", "warning",
            f"{len(opt.missing)} trainable parameters are in no optimizer group: they never change.",
            f"missing: {_listing(opt.missing)}",
            "Build the optimizer from model.parameters() after wrapping, or freeze those parameters "
            "(requires_grad_(False)) if they are not meant to train.",
        )


def one_giant_unit(r: RankReport) -> Iterator[Raw]:
    total = sum(math.prod(p.global_shape) for p in r.params) or 1
    for unit in r.units:
        inside = [b for b in r.blocks if any(p.unit == unit.name and p.name.startswith(b + ".") for p in r.params)]
        share = unit.numel / total
        if share > 0.5 and len(inside) >= 2:
            kinds = sorted({r.blocks[b] for b in inside})
            yield Raw(
                "one-giant-unit", "warning",
                f"One FSDP unit ({unit_label(unit.name)}) holds {share:.0%} of the parameters, including {len(inside)} "
                "blocks that could be units of their own: every rank all-gathers it whole, so peak memory is the "
                "whole unit and no communication overlaps compute.",
                f"unit {unit_label(unit.name)}: {unit.params} parameters, {unit.numel:,} of {total:,} elements; blocks "
                f"inside it: {_listing(inside)} ({', '.join(kinds)})",
                f"Wrap each block, then the root. FSDP2: `for block in ...: fully_shard(block)` then "
                f"`fully_shard(model)`; FSDP1: `auto_wrap_policy=ModuleWrapPolicy({{{', '.join(kinds)}}})`.",
            )


def no_shard(r: RankReport) -> Iterator[Raw]:
    units = [u for u in r.units if u.shard_size == 1 and u.params]
    if units and r.world_size > 1:
        yield Raw(
            "no-shard", "warning",
            f"{len(units)} FSDP unit(s) do not shard (NO_SHARD): each of the {r.world_size} ranks holds every "
            "parameter, gradient and optimizer state of them, as with DDP.",
            "; ".join(f"{unit_label(u.name)}: {u.api} {u.strategy}, shard size {u.shard_size}, "
                      f"{u.replicate_size} replicas" for u in units[:5]),
            "FSDP1: sharding_strategy=ShardingStrategy.FULL_SHARD (HYBRID_SHARD to shard within a node); FSDP2: a "
            "mesh whose shard dimension spans the ranks, e.g. init_device_mesh(device, (world_size,)). If "
            "replication is what you want, DDP does it with less overhead.",
        )


def _fp16_sites(r: RankReport) -> list[str]:
    sites = [f"unit {unit_label(u.name)} {kind}" for u in r.units for kind in ("param_dtype", "reduce_dtype")
             if getattr(u, kind) == "float16"]
    return sites + [f"parameter {p.name}" for p in r.params if p.dtype == "float16" and p.requires_grad]


def fp16_without_scaler(r: RankReport) -> Iterator[Raw]:
    sites = _fp16_sites(r)
    if sites and not r.scaler:
        yield Raw(
            "fp16-without-scaler", "error",
            "Training computes in fp16 without a gradient scaler: small gradients underflow to zero and large "
            "ones overflow to inf.",
            f"fp16 at: {_listing(sites)}; no enabled grad scaler was passed",
            "Use bf16 (MixedPrecision(param_dtype=torch.bfloat16) / MixedPrecisionPolicy(param_dtype="
            "torch.bfloat16)), or scale the loss: ShardedGradScaler for FSDP1, torch.amp.GradScaler for FSDP2.",
        )


def mixed_fp16_bf16(r: RankReport) -> Iterator[Raw]:
    where: dict[str, list[str]] = {"float16": [], "bfloat16": []}
    for u in r.units:
        for kind in ("param_dtype", "reduce_dtype"):
            if getattr(u, kind) in where:
                where[getattr(u, kind)].append(f"unit {unit_label(u.name)} {kind}")
    for p in r.params:
        if p.dtype in where:
            where[p.dtype].append(f"parameter {p.name}")
    if all(where.values()):
        yield Raw(
            "mixed-fp16-bf16", "error",
            "fp16 and bf16 are both in use: tensors are cast between two low-precision formats with different "
            "ranges, and units cannot share one all-gather dtype.",
            f"float16 at: {_listing(where['float16'], 3)}; bfloat16 at: {_listing(where['bfloat16'], 3)}",
            "Pick one low-precision dtype for every unit (the same MixedPrecision / MixedPrecisionPolicy "
            "everywhere; bf16 where supported) and keep the stored parameters in fp32.",
        )


def flat_params(r: RankReport) -> Iterator[Raw]:
    units = [u for u in r.units if u.use_orig_params is False and u.params]
    if units:
        names = [p.name for p in r.params if p.unit in {u.name for u in units}]
        yield Raw(
            "use-orig-params-false", "warning",
            f"{len(units)} FSDP1 unit(s) flatten their parameters (use_orig_params=False): "
            f"model.named_parameters() yields one '_flat_param' per unit instead of {len(names)} names, so "
            "per-parameter optimizer groups, weight-decay exclusions, weight sync by name and per-parameter "
            "diagnostics cannot address them.",
            f"units: {_listing([unit_label(u.name) for u in units])}; hidden parameters: {_listing(names)}",
            "FSDP(..., use_orig_params=True), or move to FSDP2 (fully_shard), which keeps every parameter.",
        )


def weights_replaced(r: RankReport) -> Iterator[Raw]:
    replaced = [p for p in r.params if p.replaced]
    if replaced:
        shown = [f"{p.name} (now {list(p.replacement_shape) if p.replacement_shape else 'missing'}, FSDP holds "
                 f"{list(p.local_shape)} of {list(p.global_shape)})" for p in replaced]
        yield Raw(
            "weights-loaded-after-wrap", "error",
            f"{len(replaced)} parameter(s) were set on their modules after FSDP wrapped them (e.g. "
            "`module.weight = nn.Parameter(...)` or load_state_dict(..., assign=True)): FSDP keeps computing with "
            "its own shards, so the loaded values are silently dropped or the next forward fails.",
            f"replaced: {_listing(shown, 3)}",
            "Load weights before wrapping, or through the FSDP-aware API: FSDP2 "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict; FSDP1 model.load_state_dict under "
            "FSDP.state_dict_type(...).",
        )


def frozen_trainable_mixed(r: RankReport) -> Iterator[Raw]:
    for unit in r.units:
        if unit.api != "FSDP1":
            continue
        mine = [p for p in r.params if p.unit == unit.name]
        frozen = [p for p in mine if not p.requires_grad]
        if frozen and len(frozen) < len(mine):
            wasted = sum(p.local_bytes for p in frozen)
            yield Raw(
                "frozen-trainable-mixed", "warning",
                f"FSDP1 unit {unit_label(unit.name)} mixes frozen and trainable parameters in one flat parameter: "
                "gradient memory is allocated and reduced for the frozen ones too.",
                f"{len(frozen)} frozen ({_listing([p.name for p in frozen], 3)}), {len(mine) - len(frozen)} "
                f"trainable; about {_size(wasted)} of gradient per rank for frozen weights",
                "Put frozen modules in units of their own (an auto_wrap_policy that wraps them separately), or "
                "use FSDP2, which tracks requires_grad per parameter.",
            )


def wrong_device(r: RankReport) -> Iterator[Raw]:
    offloaded = {u.name for u in r.units if u.offload}
    misplaced = [f"parameter {p.name} on {p.device}" for p in r.params
                 if p.device != r.device and not (p.unit in offloaded and p.device == "cpu")]
    misplaced += [f"buffer {b.name} on {b.device}" for b in r.buffers if b.device != r.device]
    if misplaced:
        yield Raw(
            "wrong-device", "error",
            f"{len(misplaced)} tensor(s) are not on the compute device {r.device}: the next forward fails with a "
            "device mismatch, or (on meta) they were never materialised.",
            f"{_listing(misplaced)}",
            "Move the whole model to its device before wrapping (FSDP1: device_id=...; FSDP2: model.to(device)), "
            "and after meta-device init call model.to_empty(device=...) then initialise every parameter and buffer.",
        )


def unwrapped_params(r: RankReport) -> Iterator[Raw]:
    if r.world_size < 2:
        return
    if not r.units:
        yield Raw("no-fsdp-units", "warning", "The model has no FSDP unit: nothing is sharded.",
                  f"{len(r.params)} parameters, none managed by FSDP",
                  "Wrap it: FSDP2 fully_shard per block then the root; FSDP1 FSDP(model, auto_wrap_policy=...).")
        return
    loose = [p for p in r.params if p.unit is None]
    if loose:
        total = sum(math.prod(p.global_shape) for p in r.params) or 1
        share = sum(math.prod(p.global_shape) for p in loose) / total
        trainable = [p for p in loose if p.requires_grad]
        yield Raw(
            "unwrapped-params", "error" if trainable else "warning",
            f"{len(loose)} parameter(s) ({share:.0%} of the elements) belong to no FSDP unit: every rank holds them "
            "whole" + (", and their gradients are not averaged across ranks, so the ranks drift apart." if trainable
                       else "."),
            f"unwrapped: {_listing([p.name for p in loose])}",
            "Apply fully_shard to the root module last (it takes every parameter not in a sub-unit), or wrap the "
            "module that holds them.",
        )


def ranks_differ(reports: Sequence[RankReport]) -> Iterator[Raw]:
    bad: list[str] = []
    ranks: set[int] = set()
    for key in sorted({k for r in reports for k in r.checksums}):
        values = {r.rank: r.checksums[key] for r in reports if key in r.checksums}
        reference, odd = outliers(values)
        if odd:
            agree = min(rank for rank, v in values.items() if v == reference)
            bad.append(f"{key} on rank {', '.join(map(str, odd))} differs from rank {agree}")
            ranks.update(odd)
    if bad:
        yield Raw(
            "ranks-differ", "error",
            f"Ranks hold different values for {len(bad)} tensor(s) that must be identical on every rank "
            "(replicated parameters, buffers, rollout-engine weights).",
            _listing(bad),
            "Start every rank from the same weights: the same seed before building the model, FSDP1 "
            "sync_module_states=True, or the same checkpoint on every rank (FSDP2: set_model_state_dict(..., "
            "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))); parameters outside FSDP "
            "drift apart in training (see unwrapped-params); if an engine copy differs, re-sync its weights.",
            tuple(sorted(ranks)),
        )


def memory_not_sharded(reports: Sequence[RankReport]) -> Iterator[Raw]:
    n = reports[0].world_size
    if n < 2 or len(reports) < n:
        return
    whole = whole_state_bytes(reports)
    per_rank = {r.rank: rank_state_bytes(r) for r in reports}
    worst = max(per_rank, key=lambda k: sum(per_rank[k].values()))
    share = sum(per_rank[worst].values()) / max(sum(whole.values()), 1)
    if share > (1 + 1 / n) / 2:
        parts = [f"{k} {_size(per_rank[worst][k])} of {_size(whole[k])}" for k in whole if whole[k]]
        yield Raw(
            "memory-not-sharded", "warning",
            f"Per-rank training state does not drop with more ranks: rank {worst} holds {share:.0%} of the whole "
            f"model's parameters, gradients and optimizer state, where {n} ranks should hold {1 / n:.0%} each.",
            f"rank {worst}: {'; '.join(parts)}",
            "Find what every rank holds whole (sharding(...).params rows with shards == 1, optimizer tensors the "
            "model does not own) and shard it: FULL_SHARD, wrap unmanaged modules, build the optimizer after "
            "wrapping. memory_scaling(...) compares world sizes.",
            tuple(range(n)),
        )


def memory_will_not_fit(est: MemoryEstimate) -> Iterator[Raw]:
    if est.fits:
        return
    s, phase = est.setting, est.peak_phase
    terms = ", ".join(f"{k} {v:.1f}" for k, v in est.phases[phase].items() if v >= 0.05)
    fixes = [str(f) for f in est.fixes]
    if not any(f.peak_gib <= s.device_memory_gib for f in est.fixes):
        fixes.append("no single change fits: combine them")
    yield Raw(
        "memory-will-not-fit", "error",
        f"The estimated per-rank peak, {est.peak_gib:.1f} GiB in the {phase} phase, exceeds the device's "
        f"{s.device_memory_gib:.1f} GiB: the run would stop with torch.OutOfMemoryError.",
        f"{est.shape.num_parameters / 1e6:,.1f}M parameters on {s.world_size} rank(s) ({s.sharding} sharding), "
        f"{s.tokens_per_micro_batch:,} tokens per micro-batch ({s.sequence_tokens} per row); GiB in {phase}: {terms}",
        "; ".join(fixes),
        tuple(range(s.world_size)),
    )


def memory_is_tight(est: MemoryEstimate) -> Iterator[Raw]:
    if not est.tight:
        return
    s, phase = est.setting, est.peak_phase
    yield Raw(
        "memory-is-tight", "warning",
        f"The estimated per-rank peak, {est.peak_gib:.1f} GiB in the {phase} phase, is "
        f"{est.peak_gib / s.device_memory_gib:.1%} of the device's {s.device_memory_gib:.1f} GiB, within the "
        "estimate's own error: the run may stop with torch.OutOfMemoryError.",
        f"{est.shape.num_parameters / 1e6:,.1f}M parameters on {s.world_size} rank(s), "
        f"{s.tokens_per_micro_batch:,} tokens per micro-batch",
        "; ".join(str(f) for f in est.fixes) or "lower the peak by any of the memory settings",
        tuple(range(s.world_size)),
    )


def host_memory_will_not_fit(est: MemoryEstimate) -> Iterator[Raw]:
    if est.host_fits:
        return
    s, held = est.setting, est.host_gib
    parts = ", ".join(f"{k} {v:.1f}" for k, v in held.items() if v)
    yield Raw(
        "host-memory-will-not-fit", "error",
        f"One host's ranks would hold {sum(held.values()):.1f} GiB of host memory, more than "
        f"{1 - HOST_HEADROOM:.0%} of its {s.host_memory_gib:.1f} GiB: the OS would kill a rank (out of memory) "
        "in its first update.",
        f"{s.host_ranks} rank(s) on the host, {est.shape.num_parameters / 1e6:,.1f}M parameters; GiB: {parts}",
        "spread the ranks over more hosts (each holds a smaller shard); or train LoRA adapters (lora.rank > 0: "
        "the offloaded state shrinks to the adapters'); or, where the device fits the state, fsdp.cpu_offload=False",
        tuple(range(s.world_size)),
    )


PER_RANK = (optimizer_before_wrap, one_giant_unit, no_shard, fp16_without_scaler, mixed_fp16_bf16, flat_params,
            weights_replaced, frozen_trainable_mixed, wrong_device, unwrapped_params)
ACROSS_RANKS = (ranks_differ, memory_not_sharded)
PREFLIGHT = (memory_will_not_fit, memory_is_tight, host_memory_will_not_fit)
