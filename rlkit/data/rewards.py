"""Reward functions: plain callables ``fn(prompts, completions, **fields) -> list[float | None]``, weighted."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


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

    A function may return None for a sample it has no opinion on (a term that applies to some rows only): that
    term is left out of the sample's weighted sum and its value is NaN in ``by_name``. The other terms keep their
    weights (not renormalised, as TRL's nansum); a sample that no term scored gets 0, with a warning.

    Args:
        scored: terms already computed elsewhere, by name: ([B] values, weight), e.g. a reward model
            on the workers (whose failures are not the reward function's to report).
    Returns:
        total: [B] float32, the weighted sum of the terms that scored each sample.
        by_name: each term's [B] float32 values (NaN where it returned None).
    Raises:
        RewardError: a function raised, returned the wrong length, a non-number or NaN/inf.
    """
    by_name = {t.name: _call(t, prompts, completions, fields) for t in terms}
    weighted = [(by_name[t.name], t.weight) for t in terms]
    for name, (values, weight) in (scored or {}).items():
        by_name[name] = values.float()
        weighted.append((by_name[name], weight))
    total = torch.zeros(len(completions))
    for values, weight in weighted:
        total += weight * values.nan_to_num(0.0)
    unscored = [i for i in range(len(completions)) if weighted and all(v[i].isnan() for v, _ in weighted)]
    if unscored:
        i = unscored[0]
        logger.warning(
            "%d sample(s) got None from every reward function and count as reward 0, e.g. sample %d (prompt %r, "
            "completion %r): make at least one function score every sample",
            len(unscored), i, prompts[i][:80], completions[i][:80],
        )  # fmt: skip
    return total, by_name


def _call(
    term: WeightedReward, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
) -> torch.Tensor:
    """[B] float32 values of one term (NaN where it returned None); called once, never again to find a sample."""
    try:
        values = term.fn(prompts, completions, **fields)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(
            f"reward function {term.name!r} raised {type(exc).__name__}: {exc}{_raised_at(term, exc)}"
        ) from exc
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
        if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise RewardError(
                f"reward function {term.name!r} returned {v!r} for sample {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r}): expected a finite number (or None)"
            )
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def _raised_at(term: WeightedReward, exc: Exception) -> str:
    """Where ``exc`` was raised: the innermost line of the function's own file, else the innermost line."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is the call in _call
    if not frames:
        return ""
    try:
        own = inspect.getsourcefile(term.fn)
    except TypeError:
        own = None
    frame = next((f for f in reversed(frames) if own and f.filename == own), frames[-1])
    line = f": {frame.line}" if frame.line else ""
    return f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name}{line})"
