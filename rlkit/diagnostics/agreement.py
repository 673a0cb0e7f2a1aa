"""Cross-rank agreement: exact tensor fingerprints, and which ranks disagree with the majority."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping

import torch
import torch.nn.functional as F

_ROW = 1 << 15  # |int32 bits| * row weight * row length < 2**61: row sums stay exact in int64
_BLOCK = 1 << 22  # elements converted to int64 at a time (bounds the temporary memory)
_PRIME = (1 << 61) - 1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def checksum(tensor: torch.Tensor) -> int:
    """An exact, order-sensitive fingerprint of a tensor's bits, computed on its own device.

    Equal tensors give equal values on every rank and device; any changed bit
    (almost surely) changes it. Integer arithmetic only, so no rounding differs.
    """
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.contiguous().view(_BITS[flat.element_size()])
    weights = torch.arange(1, _ROW + 1, device=bits.device, dtype=torch.int64)
    total = bits.numel()
    for start in range(0, bits.numel(), _BLOCK):
        block = bits[start : start + _BLOCK].to(torch.int64)
        rows = F.pad(block, (0, -block.numel() % _ROW)).view(-1, _ROW)
        for row_sum in (rows * weights).sum(dim=1).tolist():
            total = (total * 1_000_003 + row_sum) % _PRIME
    return total


def outliers(values: Mapping[int, Hashable]) -> tuple[Hashable, list[int]]:
    """The majority value over ranks (ties go to the lowest rank's value) and the ranks that differ from it."""
    counts = Counter(values.values())
    best = max(counts.values())
    reference = next(v for _, v in sorted(values.items()) if counts[v] == best)
    return reference, sorted(rank for rank, v in values.items() if v != reference)
