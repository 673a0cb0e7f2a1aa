"""``inspect(model, optimizer)``: one rank's facts about its FSDP model, as plain picklable data.

Run it on every rank (through ``cluster.run`` or inside your own torchrun
workers) and combine the per-rank reports on one process with
:func:`rlkit.diagnostics.sharding`, :func:`rlkit.diagnostics.lint` and
:func:`rlkit.diagnostics.memory_scaling`. Without a controller::

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, inspect(model, optimizer))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rlkit.diagnostics.agreement import checksum
from rlkit.diagnostics.layout import Layout, Param, discover
from rlkit.diagnostics.memory import storage_bytes
from rlkit.fsdp.full_params import clean_name


@dataclass(kw_only=True)
class UnitInfo:
    """One FSDP unit's settings and this rank's share of it."""

    name: str
    """Module path ("" is the root)."""
    api: str
    """"FSDP1" or "FSDP2"."""
    strategy: str | None
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD (FSDP2 settings named the FSDP1 way); None: no parameters."""
    shard_size: int | None
    """Ranks each parameter is split over."""
    replicate_size: int | None
    """Copies of each shard across ranks."""
    param_dtype: str | None
    """Compute dtype of mixed precision (None: the parameters' own)."""
    reduce_dtype: str | None
    """Gradient reduction dtype (None: the compute dtype)."""
    reshard_after_forward: bool | None
    offload: bool
    """Parameters offloaded to CPU."""
    use_orig_params: bool | None
    """FSDP1 only."""
    device: str | None
    """The compute device."""
    params: int
    numel: int
    """Elements of the unit's parameters, whole (not sharded)."""
    local_bytes: int
    """This rank's storage for the unit (padding included)."""


@dataclass(kw_only=True)
class ParamInfo:
    """One parameter as this rank holds it."""

    name: str
    unit: str | None
    """The FSDP unit managing it; None when no unit does."""
    global_shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]
    """FSDP1 holds a flat 1-D slice; FSDP2 a slice of dim 0."""
    local_numel: int
    local_bytes: int
    device: str
    requires_grad: bool
    shards: int
    shard_index: int
    grad_bytes: int
    """This rank's gradient for it (0 before backward or after zero_grad(set_to_none=True))."""
    optim_bytes: int
    """This rank's optimizer state for it."""
    replaced: bool
    """Set on the module after wrapping, so FSDP no longer manages what the module holds."""
    replacement_shape: tuple[int, ...] | None = None


@dataclass(kw_only=True)
class TensorInfo:
    """A buffer, or a tensor the optimizer holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int


@dataclass(kw_only=True)
class OptimizerInfo:
    groups: int
    tensors: int
    foreign: list[TensorInfo]
    """Tensors the optimizer steps that are not parameters of the model (e.g. it was built before wrapping)."""
    foreign_state_bytes: int
    missing: list[str]
    """Trainable parameters of the model that no parameter group holds."""


@dataclass(kw_only=True)
class Holding:
    """What one model (the trained one, a reference, a rollout engine) holds on this rank."""

    role: str
    tensors: int
    numel: int
    bytes: int
    dtypes: list[str]
    devices: list[str]
    sharded: bool


@dataclass(kw_only=True)
class RankReport:
    """Everything :func:`inspect` found on one rank; plain data (no tensors)."""

    rank: int
    world_size: int
    device: str
    """The device the model should be on (its FSDP units' compute device, or the ``device`` argument)."""
    units: list[UnitInfo]
    params: list[ParamInfo]
    buffers: list[TensorInfo]
    blocks: dict[str, str]
    """Repeated blocks (entries of a ModuleList / Sequential holding parameters), name -> class: natural units."""
    optimizer: OptimizerInfo | None
    scaler: bool
    """A grad scaler is in use."""
    holdings: list[Holding]
    checksums: dict[str, int] = field(default_factory=dict)
    """Fingerprints of tensors that other ranks must hold identically, by "role:name" ("role:name@shard<i>"
    for a shard of a parameter that is both sharded and replicated)."""


def inspect(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: object | None = None,
    device: torch.device | str | None = None,
    others: Mapping[str, nn.Module] | None = None,
) -> RankReport:
    """This rank's sharding layout, optimizer and scaler facts and replica fingerprints of ``model``.

    Args:
        model: an FSDP1 or FSDP2 model (or one with FSDP units inside), after wrapping.
        optimizer: its optimizer, if built.
        scaler: the grad scaler (torch.amp.GradScaler / ShardedGradScaler) if one is used.
        device: where the model should live; default: its FSDP units' compute device.
        others: further models this rank holds, by role (e.g. {"reference": ref, "engine": engine_model}):
            their holdings are reported and their replicated tensors fingerprinted.
    """
    layout = discover(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    state_bytes = _optimizer_state_bytes(optimizer)
    expected = device or next((u.device for u in layout.units if u.device is not None), None) or _majority_device(model)
    buffers = [TensorInfo(name=clean_name(n), **_describe(b)) for n, b in model.named_buffers()]
    report = RankReport(
        rank=rank,
        world_size=world,
        device=str(torch.device(expected)),
        units=[_unit_info(u, layout) for u in layout.units],
        params=[_param_info(p, state_bytes) for p in layout.params],
        buffers=buffers,
        blocks=_blocks(model),
        optimizer=None if optimizer is None else _optimizer_info(optimizer, model, state_bytes),
        scaler=bool(scaler is not None and getattr(scaler, "is_enabled", lambda: True)()),
        holdings=[_holding("model", layout)],
    )
    report.checksums.update(_replica_checksums("model", model, layout, world))
    for role, other in (others or {}).items():
        other_layout = discover(other)
        report.holdings.append(_holding(role, other_layout))
        report.checksums.update(_replica_checksums(role, other, other_layout, world))
    return report


def replica_key(kind: str, name: str, shards: int, shard_index: int) -> str:
    """How a replicated tensor is named across ranks: "kind:name", or "kind:name@shard<i>" for one shard of many."""
    return f"{kind}:{name}" if shards == 1 else f"{kind}:{name}@shard{shard_index}"


def _describe(t: torch.Tensor) -> dict:
    return dict(shape=tuple(t.shape), dtype=_dtype(t.dtype), device=str(t.device), bytes=_bytes(t))


def _dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor) -> int:
    return 0 if t.device.type == "meta" else t.numel() * t.element_size()


def _unit_info(unit, layout: Layout) -> UnitInfo:
    mine = [p for p in layout.params if p.unit == unit.name]
    return UnitInfo(
        name=unit.name,
        api=unit.api,
        strategy=unit.strategy,
        shard_size=unit.shard_size,
        replicate_size=unit.replicate_size,
        param_dtype=_dtype(unit.param_dtype),
        reduce_dtype=_dtype(unit.reduce_dtype),
        reshard_after_forward=unit.reshard_after_forward,
        offload=unit.offload,
        use_orig_params=unit.use_orig_params,
        device=None if unit.device is None else str(unit.device),
        params=len(mine),
        numel=sum(math.prod(p.global_shape) for p in mine),
        local_bytes=storage_bytes(unit.storage),
    )


def _param_info(param: Param, state_bytes: dict[int, int]) -> ParamInfo:
    local = param.local()
    grad = param.grad()
    return ParamInfo(
        name=param.name,
        unit=param.unit,
        global_shape=param.global_shape,
        dtype=_dtype(param.dtype) or "unknown",
        local_shape=tuple(local.shape),
        local_numel=local.numel(),
        local_bytes=_bytes(local),
        device=str(local.device),
        requires_grad=param.requires_grad,
        shards=param.shards,
        shard_index=param.shard_index,
        grad_bytes=0 if grad is None else _bytes(grad),
        optim_bytes=_param_state_bytes(param, local, state_bytes),
        replaced=param.replaced,
        replacement_shape=None if param.replacement is None else tuple(param.replacement.shape),
    )


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """Bytes of optimizer state per parameter object id."""
    if optimizer is None:
        return {}
    out = {}
    for p, state in optimizer.state.items():
        out[id(p)] = sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _local_bytes(t: torch.Tensor) -> int:
    return _bytes(t.to_local() if hasattr(t, "to_local") else t)


def _param_state_bytes(param: Param, local: torch.Tensor, state_bytes: dict[int, int]) -> int:
    """FSDP1 without orig params keys state by the flat parameter: give each parameter its share."""
    for key in (param.orig, param.tensor):
        if key is not None and id(key) in state_bytes:
            if key is param.tensor and param.numel is not None:
                flat = param.tensor.numel() or 1
                return state_bytes[id(key)] * local.numel() // flat
            return state_bytes[id(key)]
    return 0


def _optimizer_info(optimizer: torch.optim.Optimizer, model: nn.Module, state_bytes: dict[int, int]) -> OptimizerInfo:
    in_model = {id(p) for p in model.parameters()}
    held = [(i, p) for i, group in enumerate(optimizer.param_groups) for p in group["params"]]
    held_ids = {id(p) for _, p in held}
    foreign = [(i, p) for i, p in held if id(p) not in in_model]
    return OptimizerInfo(
        groups=len(optimizer.param_groups),
        tensors=len(held),
        foreign=[TensorInfo(name=f"param_groups[{i}]", **_describe(p)) for i, p in foreign],
        foreign_state_bytes=sum(state_bytes.get(id(p), 0) for _, p in foreign),
        missing=[clean_name(n) for n, p in model.named_parameters() if p.requires_grad and id(p) not in held_ids],
    )


def _majority_device(model: nn.Module) -> torch.device:
    """The device holding most parameter elements (CPU for a model with none)."""
    counts: dict[torch.device, int] = {}
    for p in model.parameters():
        counts[p.device] = counts.get(p.device, 0) + p.numel()
    return max(counts, key=lambda device: counts[device]) if counts else torch.device("cpu")


def _blocks(model: nn.Module) -> dict[str, str]:
    """Outermost entries of ModuleLists / Sequentials with >= 2 parameterised entries (e.g. decoder layers)."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        name = clean_name(name)
        if any(name == b or name.startswith(b + ".") for b in out):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = {clean_name(f"{name}.{n}"): c for n, c in module.named_children()}
            children = {n: c for n, c in children.items() if any(True for _ in c.parameters())}
            if len(children) >= 2:
                out.update({n: type(_unwrap(c)).__name__ for n, c in children.items()})
    return out


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside an FSDP1 wrapper."""
    return getattr(module, "_fsdp_wrapped_module", module)


def _holding(role: str, layout: Layout) -> Holding:
    locals_ = [p.local() for p in layout.params]
    return Holding(
        role=role,
        tensors=len(locals_),
        numel=sum(t.numel() for t in locals_),
        bytes=sum(_bytes(t) for t in locals_),
        dtypes=sorted({_dtype(t.dtype) or "unknown" for t in locals_}),
        devices=sorted({str(t.device) for t in locals_}),
        sharded=any(p.shards > 1 for p in layout.params),
    )


def _replica_checksums(role: str, model: nn.Module, layout: Layout, world: int) -> dict[str, int]:
    """Fingerprints of what other ranks also hold: parameters split over fewer ranks than the world, and buffers."""
    out = {}
    for p in layout.params:
        local = p.local()
        if p.shards < world and local.device.type != "meta":
            out[replica_key(role, p.name, p.shards, p.shard_index)] = checksum(local)
    for name, buf in model.named_buffers():
        if buf.device.type != "meta":
            out[replica_key(role, clean_name(name), 1, 0)] = checksum(buf)
    return out
