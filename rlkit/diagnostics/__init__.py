"""Diagnostics as plain data (dataclasses and pandas), independent of Jupyter and of rlkit's trainer.

On every rank of your own FSDP1 or FSDP2 job (through ``cluster.run`` or torchrun)::

    report = inspect(model, optimizer)          # layout, optimizer, replicas: one RankReport
    grads = grad_report(model, loss=loss)       # after backward, before clipping

and on one process, with the list of per-rank results::

    sharding(reports).units    lint(reports).to_pandas()    memory_scaling(reports)
    grad_norms(grad_reports).mismatches

Per-phase memory: a :class:`MemoryTracker` on each rank, ``tracker.mark("rollout")``, then
:func:`memory_table` over the ranks' marks.

Before launch, from the config alone (no cluster)::

    check_launch(cfg, world_size=8, device="cuda")   # ConfigError: the config against the cluster, the model's family
    estimate_memory(config_json, world_size=8, device_memory_gib=139.8, ...)   # per-phase peak, fixes
    preflight(cfg, world_size=8, device_memory_gib=139.8)                      # Findings: memory-will-not-fit
    plan_run(cfg, world_size=8, device="cuda", device_memory_gib=139.8)        # the unset settings chosen to fit
"""

from rlkit.diagnostics.agreement import checksum
from rlkit.diagnostics.estimate import Fix, MemoryEstimate, estimate_memory
from rlkit.diagnostics.grads import GradNorms, GradReport, grad_norms, grad_report
from rlkit.diagnostics.inspection import RankReport, inspect
from rlkit.diagnostics.lint import Finding, Findings, lint
from rlkit.diagnostics.memory import (
    MemoryMark,
    MemoryTracker,
    device_memory_gib,
    host_memory,
    memory_mb,
    memory_table,
    visible_gpu_count,
    visible_gpu_memory_gib,
)
from rlkit.diagnostics.memory_terms import MemorySetting, ModelShape
from rlkit.diagnostics.mismatch import MismatchReport, mismatch_report
from rlkit.diagnostics.plan import MemoryPlan, PlannedSetting, plan_run
from rlkit.diagnostics.preflight import check_launch, estimate_for, memory_setting, preflight, rank_estimate
from rlkit.diagnostics.scaling import memory_scaling
from rlkit.diagnostics.sharding import Sharding, sharding

__all__ = [
    "Finding",
    "Findings",
    "Fix",
    "GradNorms",
    "GradReport",
    "MemoryEstimate",
    "MemoryMark",
    "MemoryPlan",
    "MemorySetting",
    "MemoryTracker",
    "MismatchReport",
    "PlannedSetting",
    "ModelShape",
    "RankReport",
    "Sharding",
    "check_launch",
    "checksum",
    "estimate_for",
    "estimate_memory",
    "grad_norms",
    "grad_report",
    "inspect",
    "lint",
    "device_memory_gib",
    "host_memory",
    "memory_mb",
    "visible_gpu_count",
    "visible_gpu_memory_gib",
    "memory_scaling",
    "memory_setting",
    "memory_table",
    "mismatch_report",
    "plan_run",
    "preflight",
    "rank_estimate",
    "sharding",
]
