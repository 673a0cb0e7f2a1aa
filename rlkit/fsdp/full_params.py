"""Full (unsharded) parameters of an FSDP1 or FSDP2 model, by their original names."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""What FSDP1, activation checkpointing and torch.compile insert into module and parameter paths."""


def clean_name(name: str) -> str:
    """A module or parameter path without FSDP1 / activation-checkpoint / compile wrapper segments.

    Example:
        clean_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight";  clean_name("layers.0._fsdp_wrapped_module") == "layers.0"
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "").replace(prefix.rstrip("."), "")
    return name.strip(".").replace("..", ".")


def iter_full_params(
    model: torch.nn.Module, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for each parameter (``keep``: those whose name it accepts, e.g. LoRA adapters');
    a collective: every rank consumes it all, in order.

    FSDP2 gathers one parameter at a time (peak extra memory: the largest
    parameter). FSDP1 gathers the whole model once (it has no per-parameter
    unshard); prefer FSDP2 for models that barely fit.
    """
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False):
            for name, param in _fsdp1_params(model):
                if keep is None or keep(name):
                    # summon_full_params frees these views on exit: copy so the tensor outlives the loop
                    yield name, param.detach().clone()
        return
    for name, param in model.named_parameters():
        if keep is not None and not keep(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach()


def _fsdp1_params(model: FSDP) -> Iterator[tuple[str, torch.Tensor]]:
    """(clean name, tensor) of every original parameter of an FSDP1 model in module order (tied ones once), read
    through the modules' attributes: FSDP1 on a rank that does not shard (NO_SHARD) leaves the parameters that do not
    train as plain tensors after a forward, outside ``named_parameters`` (a LoRA base's weights: their merge with
    the adapters would miss them)."""
    from torch.distributed.fsdp._flat_param import FlatParameter
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    flat: dict[int, list[str]] = {}
    for handle in _get_fsdp_handles(model):
        for info in handle.flat_param._param_infos:
            flat.setdefault(id(info.module), []).append(info.param_name)
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr in dict.fromkeys([*module._parameters, *flat.get(id(module), [])]):
            tensor = getattr(module, attr)
            if tensor is None or isinstance(tensor, FlatParameter) or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield clean_name(f"{module_name}.{attr}"), tensor
