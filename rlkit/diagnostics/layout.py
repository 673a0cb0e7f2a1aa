"""Where each parameter of a model lives under FSDP1 or FSDP2: the one module that reads FSDP internals.

FSDP has no public API for its units' settings or per-parameter shards, so this
module reads private attributes (FlatParameter metadata for FSDP1,
FSDPParamGroup / FSDPParam for FSDP2), checked against torch 2.13. The rest of
rlkit.diagnostics works on the records built here and never touches FSDP.

A parameter's replicas: ``shards`` is how many ranks split it (1 when every
rank holds all of it) and ``shard_index`` which piece this rank holds; ranks
with the same ``shard_index`` must hold identical values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Shard

from rlkit.fsdp.full_params import clean_name


@dataclass(kw_only=True)
class Unit:
    """One FSDP unit (an FSDP1 ``FullyShardedDataParallel`` or an FSDP2 ``fully_shard``-ed module)."""

    name: str
    api: str
    strategy: str | None
    shard_size: int | None
    replicate_size: int | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool | None
    offload: bool
    use_orig_params: bool | None
    device: torch.device | None
    storage: list[torch.Tensor]
    """This rank's sharded storage (padding included)."""


@dataclass(kw_only=True, eq=False)
class Param:
    """One original parameter as this rank holds it."""

    name: str
    unit: str | None
    """The unit that manages it; None when no unit does."""
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shards: int
    shard_index: int
    tensor: torch.Tensor
    """What the model registers: a DTensor (FSDP2), a FlatParameter (FSDP1) or a plain parameter."""
    orig: torch.Tensor | None = None
    """FSDP1 with use_orig_params=True: the original parameter (a view into ``tensor``)."""
    offset: int = 0
    numel: int | None = None
    """FSDP1: this parameter's slice of the flat local shard."""
    replaced: bool = False
    """The module's attribute is no longer the tensor FSDP manages (it was set after wrapping)."""
    replacement: torch.Tensor | None = None
    """What the module holds instead, when ``replaced``."""

    def local(self) -> torch.Tensor:
        """This rank's elements (FSDP1: a flat slice)."""
        if self.numel is not None:
            return _local_shard(self.tensor)[self.offset : self.offset + self.numel]
        return self.tensor.to_local() if isinstance(self.tensor, DTensor) else self.tensor

    def grad(self) -> torch.Tensor | None:
        """This rank's gradient elements, or None."""
        grad = self.tensor.grad
        if grad is None:
            return None
        if self.numel is not None:
            return grad.reshape(-1)[self.offset : self.offset + self.numel]
        return grad.to_local() if isinstance(grad, DTensor) else grad


@dataclass
class Layout:
    units: list[Unit]
    params: list[Param]


def unit_label(unit: str | None) -> str:
    """How tables name a unit: its module path, "(root)", or "(unwrapped)" for parameters no unit manages."""
    return "(unwrapped)" if unit is None else unit or "(root)"


def discover(model: nn.Module) -> Layout:
    """Every FSDP unit of ``model`` and every parameter, wrapped or not."""
    names = {id(m): clean_name(n) for n, m in model.named_modules()}
    units, params = [], []
    for module in model.modules():
        if isinstance(module, FSDP):
            unit, found = _fsdp1_unit(module, names)
        elif isinstance(module, FSDPModule):
            unit, found = _fsdp2_unit(module, names)
        else:
            continue
        units.append(unit)
        params += found
    managed = {id(t) for p in params for t in (p.tensor, p.orig, p.replacement) if t is not None}
    for name, param in model.named_parameters():
        if id(param) not in managed:
            params.append(_plain(clean_name(name), param))
    return Layout(units, params)


def _join(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def _fsdp1_unit(module: FSDP, names: dict[int, str]) -> tuple[Unit, list[Param]]:
    handle = module._handle
    strategy = module.sharding_strategy
    mp = module.mixed_precision
    shard_size = handle.world_size if handle is not None and handle.uses_sharded_strategy else 1
    world = dist.get_world_size() if dist.is_initialized() else 1
    unit = Unit(
        name=names[id(module)],
        api="FSDP1",
        strategy=strategy.name,
        shard_size=shard_size,
        replicate_size=world // shard_size,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
        offload=bool(module.cpu_offload.offload_params),
        use_orig_params=bool(module._use_orig_params),
        device=module.compute_device,
        storage=[] if handle is None else [_local_shard(handle.flat_param)],
    )
    if handle is None:
        return unit, []
    flat = handle.flat_param
    params = []
    for i, (info, shard, shape) in enumerate(
        zip(flat._param_infos, flat._shard_param_infos, flat._shapes, strict=True)
    ):
        orig = flat._params[i] if module._use_orig_params and flat._params is not None else None
        current = info.module._parameters.get(info.param_name)
        replaced = current is not orig if orig is not None else current is not None
        if not replaced and _storage_moved(orig, flat):
            replaced, current = True, orig
        params.append(
            Param(
                name=_join(names[id(info.module)], info.param_name),
                unit=unit.name,
                global_shape=tuple(shape),
                dtype=flat.dtype,
                requires_grad=orig.requires_grad if orig is not None else flat.requires_grad,
                shards=shard_size,
                shard_index=handle.rank if shard_size > 1 else 0,
                tensor=flat,
                orig=orig,
                offset=shard.offset_in_shard or 0,
                numel=shard.numel_in_shard or 0,
                replaced=replaced,
                replacement=current if replaced else None,
            )
        )
    return unit, params


def _local_shard(flat: torch.Tensor) -> torch.Tensor:
    """FSDP1: the flat parameter's local shard (before the first forward, the flat parameter itself)."""
    return getattr(flat, "_local_shard", flat.data)


def _storage_moved(orig: torch.Tensor | None, flat: torch.Tensor) -> bool:
    """FSDP1 use_orig_params=True: a non-empty original parameter must be a view into the flat parameter."""
    if orig is None or orig.numel() == 0:
        return False
    return orig.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def _fsdp2_unit(module: FSDPModule, names: dict[int, str]) -> tuple[Unit, list[Param]]:
    state = module._get_fsdp_state()
    groups = list(getattr(state, "_fsdp_param_groups", None) or [g for g in [state._fsdp_param_group] if g])
    name = names[id(module)]
    if not groups:  # a unit that manages no parameters of its own (e.g. a root whose children hold them all)
        return _empty_fsdp2_unit(state, name), []
    group = groups[0]
    mesh = group.mesh_info
    shard_size = mesh.shard_mesh_size
    replicate_size = getattr(mesh, "replicate_mesh_size", 1)
    reshard = group.post_forward_mesh_info is not None
    fsdp_params = [fp for g in groups for fp in g.fsdp_params]
    unit = Unit(
        name=name,
        api="FSDP2",
        strategy=_fsdp2_strategy(shard_size, replicate_size, reshard),
        shard_size=shard_size,
        replicate_size=replicate_size,
        param_dtype=group.mp_policy.param_dtype,
        reduce_dtype=group.mp_policy.reduce_dtype,
        reshard_after_forward=reshard,
        offload=isinstance(group.offload_policy, CPUOffloadPolicy),
        use_orig_params=None,
        device=group.device,
        storage=[fp._sharded_param_data for fp in fsdp_params],
    )
    return unit, _fsdp2_params(fsdp_params, names, name, shard_size)


def _empty_fsdp2_unit(state: Any, name: str) -> Unit:
    """An FSDP2 unit without parameter groups: only its mixed-precision policy and device to show."""
    mp = state._mp_policy
    return Unit(
        name=name,
        api="FSDP2",
        strategy=None,
        shard_size=None,
        replicate_size=None,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        reshard_after_forward=None,
        offload=False,
        use_orig_params=None,
        device=state._device,
        storage=[],
    )


def _fsdp2_params(fsdp_params: list[Any], names: dict[int, str], unit: str, shard_size: int) -> list[Param]:
    """One Param per FSDP2-managed parameter of ``unit``, with this rank's shard."""
    params = []
    for fp in fsdp_params:
        info = fp._module_info
        current = info.module._parameters.get(info.param_name)
        managed = current is fp.sharded_param or current is getattr(fp, "_unsharded_param", None)
        sharded = fp.sharded_param
        params.append(
            Param(
                name=_join(names[id(info.module)], info.param_name),
                unit=unit,
                global_shape=tuple(fp._orig_size),
                dtype=sharded.dtype,
                requires_grad=sharded.requires_grad,
                shards=shard_size,
                shard_index=fp.mesh_info.shard_mesh_rank,
                tensor=sharded,
                replaced=not managed,
                replacement=None if managed else current,
            )
        )
    return params


def _fsdp2_strategy(shard_size: int, replicate_size: int, reshard: bool) -> str:
    """FSDP2 settings in FSDP1's words, which users know."""
    if shard_size == 1:
        return "NO_SHARD"
    if replicate_size > 1:
        return "HYBRID_SHARD" if reshard else "_HYBRID_SHARD_ZERO2"
    return "FULL_SHARD" if reshard else "SHARD_GRAD_OP"


def _plain(name: str, param: torch.Tensor) -> Param:
    """A parameter no FSDP unit manages (a DTensor from another parallelism keeps its own shards)."""
    shards, index = 1, 0
    if isinstance(param, DTensor):
        coords: Sequence[int] = param.device_mesh.get_coordinate() or ()
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                index = index * param.device_mesh.size(dim) + coords[dim]
                shards *= param.device_mesh.size(dim)
    return Param(
        name=name,
        unit=None,
        global_shape=tuple(param.shape),
        dtype=param.dtype,
        requires_grad=param.requires_grad,
        shards=shards,
        shard_index=index,
        tensor=param,
    )
