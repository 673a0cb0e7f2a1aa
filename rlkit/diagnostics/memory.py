"""Per-rank memory readings."""

from __future__ import annotations

import psutil
import torch


def memory_mb(device: torch.device) -> dict[str, float]:
    """This process's memory in MiB: RSS always; allocated / reserved / peak on a CUDA device."""
    out = {"rss": psutil.Process().memory_info().rss / 2**20}
    if device.type == "cuda":
        out["allocated"] = torch.cuda.memory_allocated(device) / 2**20
        out["reserved"] = torch.cuda.memory_reserved(device) / 2**20
        out["peak"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
