"""apply_fsdp: FSDP2 ``fully_shard``, one unit per decoder layer, then the root."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlkit.config import FSDPConfig


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a Hugging Face model declares unsplittable (its decoder layers), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules, so there is nothing to wrap per layer; "
            "one giant FSDP unit would gather the whole model at once"
        )
    return layers


def param_dtype(config: FSDPConfig, device_type: str) -> torch.dtype:
    """The compute dtype: "auto" is bf16 on GPU and fp32 on CPU."""
    if config.param_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[config.param_dtype]


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, config: FSDPConfig) -> torch.nn.Module:
    """Shard ``model`` in place over the 1-D ``mesh`` and return it.

    Parameters stay fp32 (the optimizer's master copy); mixed precision casts
    them to the compute dtype for forward/backward and reduces gradients in
    ``config.reduce_dtype``.
    """
    compute = param_dtype(config, mesh.device_type)
    reduce = torch.float32 if config.reduce_dtype == "fp32" else torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    return model
