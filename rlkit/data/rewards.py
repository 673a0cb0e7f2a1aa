"""Reward functions: plain callables ``fn(prompts, completions, **fields) -> list[float]``, weighted."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RewardFn = Callable[..., list[float]]


class RewardError(ValueError):
    """A reward function raised or returned something unusable; names the function and the sample."""


@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float


def reward_terms(
    spec: RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn | tuple[RewardFn, float]],
) -> list[WeightedReward]:
    """Normalise a reward spec: one callable, a list (weight 1 each), or {name: fn or (fn, weight)}.

    A list's terms are named after their functions; a name two of them share gets the term's
    position appended (``<lambda>_0``, ``<lambda>_1``) so that neither hides the other.
    """
    if callable(spec):
        spec = [spec]
    if isinstance(spec, Mapping):
        items = [(name, *(v if isinstance(v, tuple) else (v, 1.0))) for name, v in spec.items()]
    else:
        names = [getattr(fn, "__name__", f"reward{i}") for i, fn in enumerate(spec)]
        unique = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        items = [(n, fn, 1.0) for n, fn in zip(unique, spec, strict=True)]
    if not items:
        raise ValueError("reward_fn is empty: give at least one reward function")
    out = []
    for name, fn, weight in items:
        if not callable(fn):
            raise TypeError(f"reward {name!r} is not callable: {fn!r}")
        out.append(WeightedReward(name, fn, float(weight)))
    return out


def compute_rewards(
    terms: list[WeightedReward],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list[Any]],
    *,
    scored: Mapping[str, tuple[torch.Tensor, float]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call every reward function once on the whole batch.

    Args:
        scored: terms already computed elsewhere, by name: ([B] values, weight), e.g. a reward model
            on the workers (whose failures are not the reward function's to report).
    Returns:
        total: [B] float32, the weighted sum of the terms.
        by_name: each term's [B] float32 values.
    Raises:
        RewardError: a function raised, returned the wrong length, a non-number or NaN/inf.
    """
    by_name = {t.name: _call(t, prompts, completions, fields) for t in terms}
    total = torch.zeros(len(completions))
    for t in terms:
        total += t.weight * by_name[t.name]
    for name, (values, weight) in (scored or {}).items():
        by_name[name] = values.float()
        total += weight * by_name[name]
    return total, by_name


def _call(
    term: WeightedReward, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
) -> torch.Tensor:
    try:
        values = term.fn(prompts, completions, **fields)
    except RewardError:
        raise
    except Exception as exc:
        where = _failing_sample(term, prompts, completions, fields)
        raise RewardError(f"reward function {term.name!r} raised {type(exc).__name__}: {exc}{where}") from exc
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {term.name!r} returned {type(values).__name__}, expected a list of floats"
        ) from None
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {term.name!r} returned {len(values)} values for {len(completions)} completions"
        )
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise RewardError(
                f"reward function {term.name!r} returned {v!r} for sample {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r}): expected a finite number"
            )
    return torch.tensor(values, dtype=torch.float32)


def _failing_sample(
    term: WeightedReward, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
) -> str:
    """Re-run ``term`` one sample at a time to name the first sample it raises on (only after it failed)."""
    for i in range(len(completions)):
        try:
            term.fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in fields.items()})
        except Exception:  # noqa: BLE001 - any failure names the sample
            return f" on sample {i} (prompt {prompts[i]!r}, completion {completions[i]!r})"
    return " (each sample alone scores fine: the failure depends on the whole batch)"
