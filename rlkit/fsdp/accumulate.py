"""Gradient accumulation over one optimizer step's micro-batches without FSDP's per-micro-batch work.

Left alone, FSDP2 gathers each unit's parameters (casting the fp32 shards to the compute dtype) in every
micro-batch's forward and again in its backward, and reduce-scatters (casting to the reduce dtype) every
micro-batch's gradients: 2 gathers and 1 reduction per unit and micro-batch, copies all of them even on one
rank. With ``keep_unsharded`` the units are gathered once, in the first micro-batch's forward, and stay
gathered (``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``) while the gradients
accumulate unsharded in the reduce dtype (``set_requires_gradient_sync(False)``); the last micro-batch's
backward reduces them once and reshards. The price is memory: every unit's compute-dtype parameters and its
reduce-dtype gradients at once, per rank (the estimate's ``keep_unsharded`` term decides where that fits).
FSDP1 has no setting to keep its units gathered; its ``no_sync`` accumulates the unsharded gradients in the
compute dtype, so it is used only where that is the reduce dtype. Either way the gradient is the sum over
the micro-batches, as without; only the order of the floating-point additions changes.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager, nullcontext
from typing import TypeVar

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

T = TypeVar("T")


@contextmanager
def accumulation(
    model: torch.nn.Module, micro_batches: Sequence[T], *, keep_unsharded: bool, reshard_after_forward: bool
) -> Iterator[Iterator[T]]:
    """Yields an iterator over ``micro_batches`` (one optimizer step's; the block must take them all) that sets
    ``model``'s FSDP state before handing out each one: with ``keep_unsharded`` (and more than one micro-batch)
    units stay gathered and gradients unsharded until the last one's backward. On leaving, ``model`` is as it
    was wrapped (``reshard_after_forward``: that setting); if the block raised, what was kept is dropped.
    """
    if not keep_unsharded or len(micro_batches) < 2:
        yield iter(micro_batches)
        return
    if isinstance(model, FSDP):
        with closing(_fsdp1_steps(model, micro_batches)) as steps:
            yield steps
        return
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{type(model).__name__} is not wrapped by fully_shard or FullyShardedDataParallel")
    model.set_reshard_after_forward(False)
    try:
        yield _fsdp2_steps(model, micro_batches)
    except BaseException:
        _drop_kept(model)
        raise
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_reshard_after_forward(reshard_after_forward)


def _fsdp2_steps(model: FSDPModule, micro_batches: Sequence[T]) -> Iterator[T]:
    """Each micro-batch after telling FSDP2 whether its backward is the last one of the step."""
    last = len(micro_batches) - 1
    for k, micro in enumerate(micro_batches):
        model.set_requires_gradient_sync(k == last)
        model.set_reshard_after_backward(k == last)
        yield micro


def _fsdp1_steps(model: FSDP, micro_batches: Sequence[T]) -> Generator[T, None, None]:
    """Each micro-batch but the last inside FSDP1's ``no_sync`` (entered before its forward, left after its
    backward, when the next one is asked for, or when the iterator is closed); plain where the compute dtype
    is not the reduce dtype. A failed micro-batch's unsharded gradients are FSDP1's to drop."""
    mixed = model.mixed_precision
    exact = mixed is None or mixed.param_dtype in (None, mixed.reduce_dtype)
    last = len(micro_batches) - 1
    for k, micro in enumerate(micro_batches):
        with model.no_sync() if exact and k < last else nullcontext():
            yield micro


def _drop_kept(model: FSDPModule) -> None:
    """After a failed micro-batch: free the gathered parameters and the gradients accumulated unsharded, so that
    the next step sums its own gradients only (torch 2.11 has no public call for the second)."""
    assert isinstance(model, torch.nn.Module)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None
