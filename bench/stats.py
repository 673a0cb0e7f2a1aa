"""The statistics every GPU bench reports: per-phase medians and spreads over the timed steps, and paired ratios.

A bench runs ``warmup`` steps it does not time, then ``steps`` timed ones; each phase's seconds over the timed
steps become a :func:`spread` (median, min, max, quartiles). Two runs that alternate in one process (rlkit's
engine and bare vLLM, or two variants of the update) give one :func:`paired_ratio`: the ratio of their medians
and the range and quartiles of the per-step ratios, so the ratio carries its own noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics, as numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    """median, min, max, q1 and q3 of ``values`` (NaN left out) and how many there were (``{"n": 0}``: none)."""
    values = [float(v) for v in values if v == v]
    if not values:
        return {"n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": quantile(values, 0.25), "q3": quantile(values, 0.75), "n": len(values)}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float]:
    """median(numerators) / median(denominators), and the spread of the per-pair ratios (pairs: same index)."""
    pairs = [a / b for a, b in zip(numerators, denominators, strict=True) if b]
    if not pairs:
        return {"n": 0}
    per_pair = spread(pairs)
    return {"ratio_of_medians": statistics.median(numerators) / statistics.median(denominators),
            **{f"pairs_{k}": v for k, v in per_pair.items()}}


def timed(values: Sequence[float], warmup: int) -> list[float]:
    """The timed steps: ``values`` after the first ``warmup`` (all of them when there are no more)."""
    values = list(values)
    return values[warmup:] if len(values) > warmup else values


def describe(s: dict[str, float], unit: str = "s") -> str:
    """``"7.78 s (5.30-13.5, IQR 7.10-8.00, n=8)"``."""
    if not s.get("n"):
        return "n/a"
    return (f"{s['median']:.4g} {unit} ({s['min']:.4g}-{s['max']:.4g}, IQR {s['q1']:.4g}-{s['q3']:.4g}, "
            f"n={s['n']})")


def describe_ratio(r: dict[str, float]) -> str:
    """``"1.06 (per pair 0.98-1.15, IQR 1.02-1.09, n=8)"``."""
    if not r.get("n") and not r.get("pairs_n"):
        return "n/a"
    return (f"{r['ratio_of_medians']:.3f} (per pair {r['pairs_min']:.3f}-{r['pairs_max']:.3f}, IQR "
            f"{r['pairs_q1']:.3f}-{r['pairs_q3']:.3f}, n={r['pairs_n']})")
