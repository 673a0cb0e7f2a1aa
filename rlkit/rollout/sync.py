"""Weight sync: full tensors from the FSDP actor, one parameter at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def gathered_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for each parameter, all-gathering one at a time.

    A collective per sharded parameter: every rank must consume the whole
    iterator in the same order. Peak extra memory is the largest parameter,
    never the whole model.
    """
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach()
