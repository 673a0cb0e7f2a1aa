"""What a function running on a worker knows about where it runs: ``context()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class WorkerContext:
    """This worker's place in the cluster.

    ``state`` is a dict that persists across ``cluster.run`` calls on this worker: keep long-lived
    objects (models, optimizers, rollout engines) there.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    host: str
    state: dict[str, Any] = field(default_factory=dict)


# Set once by the worker main loop; it exists only inside a worker process.
_current: WorkerContext | None = None


def context() -> WorkerContext:
    """The calling worker's context; only valid inside a function run by ``cluster.run``."""
    if _current is None:
        raise RuntimeError("rlkit.runtime.context() is only available inside a function "
                           "run on a worker by cluster.run(fn, ...)")
    return _current


def set_context(ctx: WorkerContext) -> None:
    """Install this process's context (called once by the worker at start-up)."""
    global _current
    _current = ctx
