"""What a function running on a worker knows about where it runs: ``context()``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class WorkerContext:
    """This worker's place in the cluster.

    ``state`` is a dict that persists across ``cluster.run`` calls on this worker: keep long-lived
    objects (models, optimizers, rollout engines) there. ``memory_reports`` holds the reports
    registered with ``set_memory_report``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    host: str
    state: dict[str, Any] = field(default_factory=dict)
    memory_reports: dict[str, Callable[[], Any]] = field(default_factory=dict, repr=False)

    def set_memory_report(self, name: str, fn: Callable[[], Any] | None) -> None:
        """Register ``fn`` as this rank's memory report called ``name`` (e.g. "policy"); ``None``
        removes it. When a call on this rank runs out of memory, the error the controller raises
        (``WorkerOutOfMemory``) includes ``fn()``'s report, taken on this rank at that moment: a
        str, a mapping ``{what: amount}`` (one line each; floats shown with 2 decimals, so name the
        unit, e.g. ``{"parameters GiB": 6.17}``) or a table (a DataFrame, shown as ``str()`` shows
        it). ``fn`` runs just after the allocation failed: it should read sizes, not allocate on
        the device. Registering a name again replaces its report.
        """
        if fn is None:
            self.memory_reports.pop(name, None)
        else:
            self.memory_reports[name] = fn


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
