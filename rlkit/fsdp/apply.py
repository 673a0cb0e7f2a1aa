"""apply_fsdp: shard a model with FSDP2 (default) or FSDP1, one unit per decoder layer, then the root."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlkit.config import FSDPConfig
from rlkit.models.families import decoder_layers
from rlkit.models.head import response_head
from rlkit.models.kernels import apply_kernels

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def param_dtype(config: FSDPConfig, device_type: str) -> torch.dtype:
    """The compute dtype: "auto" is bf16 on GPU and fp32 on CPU."""
    if config.param_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[config.param_dtype]


def build_mesh(device_type: str, world_size: int, config: FSDPConfig) -> DeviceMesh:
    """1-D ("shard",) mesh for full sharding; 2-D ("replicate", "shard") for hybrid and no_shard."""
    if config.sharding == "full":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    shard = 1 if config.sharding == "no_shard" else (config.hybrid_shard_size or world_size)
    return init_device_mesh(device_type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, config: FSDPConfig) -> torch.nn.Module:
    """Shard ``model`` over ``mesh`` (from :func:`build_mesh`) and return the wrapped model.

    Parameters stay fp32 (the optimizer's master copy); mixed precision casts
    them to the compute dtype for forward/backward and reduces gradients in
    ``config.reduce_dtype``. Gradients are SUMMED over ranks, not averaged (FSDP's
    default): rlkit's loss weights already divide by the whole batch's token or
    sequence count over all ranks, so the sum is the gradient of the whole batch's
    loss. Each decoder layer is, in this order (torchtitan's), checkpointed
    (``config.activation_checkpointing``), compiled (``config.compile``; a fused
    :class:`~rlkit.models.head.ResponseHead` compiles its chunk math too) and
    sharded; parameter names do not change. Before all of it, ``config.kernels="liger"`` swaps Liger's fused
    kernels into the layers (:func:`~rlkit.models.kernels.apply_kernels`). Build the optimizer after this call.
    """
    apply_kernels(model, config.kernels)
    if config.version == 1:
        return _apply_fsdp1(model, mesh, config)
    compute = param_dtype(config, mesh.device_type)
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=DTYPES[config.reduce_dtype]),
        reshard_after_forward=config.reshard_after_forward,
    )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    _prepare_layers(model, config)
    units = [fully_shard(layer, **kwargs) for layer in decoder_layers(model)] + [fully_shard(model, **kwargs)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM collective, which gloo supports too
    return model


def _prepare_layers(model: torch.nn.Module, config: FSDPConfig) -> None:
    """Before FSDP2 wraps them: checkpoint and compile each decoder layer, and the fused head's chunk math."""
    for layer in decoder_layers(model):
        if config.activation_checkpointing:
            checkpoint(layer)  # composable: forward hooks, the module tree and names stay as they are
        if config.compile:
            # the forward only: FSDP's and the checkpoint's hooks stay outside the compiled code
            layer.forward = torch.compile(layer.forward)
    head = response_head(model)
    if config.compile and head is not None:
        head.compile_chunk_math()


def _apply_fsdp1(model: torch.nn.Module, mesh: DeviceMesh, config: FSDPConfig) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy

    compute = param_dtype(config, mesh.device_type)
    strategy = {
        "full": ShardingStrategy.FULL_SHARD if config.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        "hybrid": ShardingStrategy.HYBRID_SHARD
        if config.reshard_after_forward
        else ShardingStrategy._HYBRID_SHARD_ZERO2,
        "no_shard": ShardingStrategy.NO_SHARD,
    }[config.sharding]
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    layer_types = tuple({type(layer) for layer in decoder_layers(model)})
    # LoRA: a flat parameter holds one dtype and takes gradients for all or none, so the trained leaves (adapters,
    # modules_to_save) get units of their own beside the frozen base's
    frozen = any(not p.requires_grad for p in model.parameters())

    def own_unit(module: torch.nn.Module) -> bool:
        return isinstance(module, layer_types) or (frozen and _trained_leaf(module))

    wrapped = FSDP(
        model,
        auto_wrap_policy=CustomPolicy(own_unit),
        sharding_strategy=strategy,
        # LoRA: peft casts an adapter's input to its weight's dtype as seen outside the unit (the fp32 shard),
        # then the unit gathers that weight in the compute dtype: the unit casts its inputs back
        mixed_precision=MixedPrecision(
            param_dtype=compute, reduce_dtype=DTYPES[config.reduce_dtype], cast_forward_inputs=frozen
        ),
        backward_prefetch=prefetch[config.backward_prefetch],
        cpu_offload=CPUOffload(offload_params=bool(config.cpu_offload)),
        device_id=device,
        device_mesh=mesh if config.sharding == "hybrid" else None,
        use_orig_params=True,
    )
    for unit in FSDP.fsdp_modules(wrapped):
        # FSDP1 has no public setting for this: its gradient reduction divides by these two factors
        unit._gradient_predivide_factor = 1
        unit._gradient_postdivide_factor = 1
    if config.activation_checkpointing:  # after wrapping; names gain _checkpoint_wrapped_module (see clean_name)
        apply_activation_checkpointing(
            wrapped,
            checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda module: isinstance(module, layer_types),
        )
    return wrapped


def _trained_leaf(module: torch.nn.Module) -> bool:
    """A module without children whose parameters all train (a LoRA matrix, a modules_to_save copy's layer)."""
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.requires_grad for p in params)
