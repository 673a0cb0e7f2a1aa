"""The memory plan and estimate of a GRPO/PPO run on a launched cluster (its devices' and hosts' real sizes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rlkit import diagnostics
from rlkit.config import RLConfig
from rlkit.runtime import Cluster


def plan_on_cluster(cluster: Cluster, config: RLConfig, model_dir: Path) -> diagnostics.MemoryPlan:
    """:func:`rlkit.diagnostics.plan_run` for ``config`` on ``cluster``: on GPUs the smallest device's memory and
    the hosts' (ConfigError when no plan fits); on CPUs nothing is sized."""
    if cluster.device != "cuda":
        return diagnostics.plan_run(config, model_dir, world_size=cluster.world_size, device="cpu")
    return diagnostics.plan_run(config, model_dir, world_size=cluster.world_size, device="cuda",
                                **_sizes(cluster))  # fmt: skip


def estimate_on_cluster(
    cluster: Cluster, config: RLConfig, model_dir: Path, device_memory_gib: float | None = None
) -> diagnostics.MemoryEstimate:
    """The memory estimate of ``config`` on ``cluster``'s GPUs, or on devices of ``device_memory_gib`` (required on
    a CPU cluster: the estimate is a GPU's)."""
    if device_memory_gib is not None:
        return diagnostics.estimate_for(config, model_dir, world_size=cluster.world_size,
                                        device_memory_gib=device_memory_gib)  # fmt: skip
    if cluster.device != "cuda":
        raise ValueError("a CPU cluster has no GPU to estimate for: give device_memory_gib (e.g. 79.2 for an H100)")
    return diagnostics.estimate_for(config, model_dir, world_size=cluster.world_size, **_sizes(cluster))


def findings_on_cluster(cluster: Cluster, config: RLConfig, model_dir: Path) -> diagnostics.Findings:
    """The preflight memory estimate's findings for ``config`` on ``cluster``'s GPUs (none on CPU)."""
    if cluster.device != "cuda":
        return diagnostics.Findings([])
    return diagnostics.preflight(config, model_dir, world_size=cluster.world_size, **_sizes(cluster))


def _sizes(cluster: Cluster) -> dict[str, Any]:
    """The smallest device's memory, the smallest host's, and the most ranks on one host."""
    hosts = cluster.run(diagnostics.host_memory)  # (name, GiB) per rank
    return {
        "device_memory_gib": min(cluster.run(diagnostics.device_memory_gib)),
        "host_memory_gib": min(total for _, total in hosts),
        "ranks_per_host": max(Counter(name for name, _ in hosts).values()),
    }
