"""Dynamic sampling on the controller (DAPO, Yu et al. 2025): keep the prompt groups that teach something.

A group whose samples all got the same reward has zero advantage under the group estimators, so it
adds nothing to the policy gradient. With ``dynamic_sampling`` the step draws more scored rollouts
until ``prompts_per_step`` informative groups are in hand, or ``max_refill_rounds`` extra rounds are
spent; then uninformative groups fill the rest, so every step trains on the same number of samples
(it must divide across the ranks). Unlike DAPO's trainer, which keeps generating until the batch is
full, the cap bounds a step's time; the history says how often it was reached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.algos import informative_groups
from rlkit.data.batch import Batch


def refill_informative(
    first: Batch, draw: Callable[[int], Batch], *, groups: int, max_rounds: int
) -> tuple[Batch, dict]:
    """``groups`` whole prompt groups, informative ones first, from ``first`` and up to ``max_rounds`` more draws.

    Each drawn batch's group ids are renumbered past every id already in hand, so rows of different prompts
    never share a group, whatever ids ``first`` carries (e.g. an earlier refill's, retried after a reward failure).

    Args:
        first: a scored batch of ``groups`` groups (any group ids).
        draw: ``draw(round)`` -> the next scored batch (round 1, 2, ...), its group ids 0 .. groups - 1.
    Returns:
        the batch, and the metrics sampling/rounds (extra draws made), sampling/informative_frac (of the
        first draw's groups) and sampling/filled (uninformative groups that filled the step).
    """
    batches, rounds = [first], 0
    keep = [informative_groups(first.filled("rewards"), first.group)]
    first_frac = _group_count(first, keep[0]) / groups
    while sum(_group_count(b, k) for b, k in zip(batches, keep, strict=True)) < groups and rounds < max_rounds:
        rounds += 1
        drawn = draw(rounds)
        drawn.group = drawn.group + int(torch.cat([b.group for b in batches]).max()) + 1
        batches.append(drawn)
        keep.append(informative_groups(batches[-1].filled("rewards"), batches[-1].group))
    joined = Batch.concat(batches)
    informative = torch.cat(keep)
    order = torch.cat([informative.nonzero().flatten(), (~informative).nonzero().flatten()])
    chosen = _first_groups(joined.group[order], groups)
    batch = joined.select(order[chosen])
    filled = groups - _group_count(batch, informative[order[chosen]])
    metrics = {
        "sampling/rounds": float(rounds),
        "sampling/informative_frac": first_frac,
        "sampling/filled": float(filled),
    }
    return batch, metrics


def _group_count(batch: Batch, rows: torch.Tensor) -> int:
    """How many distinct groups the selected rows of ``batch`` belong to."""
    return int(batch.group[rows].unique().numel())


def _first_groups(group: torch.Tensor, count: int) -> torch.Tensor:
    """[k] positions of the rows of the first ``count`` distinct groups, in order of first appearance."""
    seen: list[int] = []
    for g in group.tolist():
        if g not in seen:
            seen.append(g)
        if len(seen) == count:
            break
    wanted = torch.tensor(seen[:count])
    return torch.isin(group, wanted).nonzero().flatten()
