"""Diagnostics as plain data (dataclasses and pandas), independent of Jupyter and of rlkit's trainer.

On every rank of your own FSDP1 or FSDP2 job (through ``cluster.run`` or torchrun)::

    report = inspect(model, optimizer)          # layout, optimizer, replicas: one RankReport
    grads = grad_report(model, loss=loss)       # after backward, before clipping

and on one process, with the list of per-rank results::

    sharding(reports).units    lint(reports).to_pandas()    memory_scaling(reports)
    grad_norms(grad_reports).mismatches

Per-phase memory: a :class:`MemoryTracker` on each rank, ``tracker.mark("rollout")``, then
:func:`memory_table` over the ranks' marks.
"""

from rlkit.diagnostics.agreement import checksum
from rlkit.diagnostics.grads import GradNorms, GradReport, grad_norms, grad_report
from rlkit.diagnostics.inspection import RankReport, inspect
from rlkit.diagnostics.lint import Finding, Findings, lint
from rlkit.diagnostics.memory import MemoryMark, MemoryTracker, memory_mb, memory_table
from rlkit.diagnostics.scaling import memory_scaling
from rlkit.diagnostics.sharding import Sharding, sharding

__all__ = [
    "Finding",
    "Findings",
    "GradNorms",
    "GradReport",
    "MemoryMark",
    "MemoryTracker",
    "RankReport",
    "Sharding",
    "checksum",
    "grad_norms",
    "grad_report",
    "inspect",
    "lint",
    "memory_mb",
    "memory_scaling",
    "memory_table",
    "sharding",
]
