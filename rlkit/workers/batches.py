"""Runs on every rank: the rows a role trains on, and the mini-/micro-batches it walks through them in.

Every rank must run the same number of forward passes in a phase (FSDP's collectives pair up
across ranks), so the generators here cut each rank's equal share the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist


@dataclass(kw_only=True)
class Rows:
    """Base of the per-rank training rows: dataclasses whose fields are [n, ...] tensors (or None)."""

    input_ids: torch.Tensor
    """[n, P + T] int64 prompt (left-padded) then response (right-padded) token ids."""
    attention_mask: torch.Tensor
    """[n, P + T] int64, 1 on real tokens."""
    response_mask: torch.Tensor
    """[n, T] float32, 1 on generated tokens."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self: RowsT, index: slice | torch.Tensor) -> RowsT:
        """The rows at ``index`` (a slice or an index tensor), every field alike."""
        return dataclasses.replace(self, **{name: value[index] for name, value in self._tensors().items()})

    def to(self: RowsT, device: torch.device) -> RowsT:
        return dataclasses.replace(self, **{name: value.to(device) for name, value in self._tensors().items()})

    def filled(self, name: str) -> torch.Tensor:
        """The tensor field ``name``; a ValueError naming it when it is None."""
        value = getattr(self, name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"these rows have no {name}")
        return value

    def _tensors(self) -> dict[str, torch.Tensor]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}


RowsT = TypeVar("RowsT", bound=Rows)


@dataclass(kw_only=True)
class PolicyRows(Rows):
    """One rank's rows for the policy update."""

    advantages: torch.Tensor
    """[n, T] float32 per-token advantages."""
    old_logprobs: torch.Tensor | None = None
    """[n, T] log-probs under the policy that sampled the rows; None: the update's first forward gives them
    (one optimizer step per batch, ``recompute_logprobs=False``)."""
    ref_logprobs: torch.Tensor | None = None
    """[n, T] under the frozen reference (when the loss has a KL term)."""
    rollout_logprobs: torch.Tensor | None = None
    """[n, T] under the rollout engine that sampled (NaN on rows it returned none for): the mismatch metrics and
    the rollout correction's weights; None: neither."""


@dataclass(kw_only=True)
class CriticRows(Rows):
    """One rank's rows for the critic update."""

    old_values: torch.Tensor
    """[n, T] the critic's values at rollout time (the value clip's anchor)."""
    returns: torch.Tensor
    """[n, T] the value targets."""


@dataclass(kw_only=True)
class PreferenceRows(Rows):
    """One rank's completions for a preference update, one per row: prompt (left-padded), completion (right-padded).

    DPO: two rows per pair, its chosen completion then its rejected one (rows 2i and 2i + 1); KTO: one row per
    example. ``response_mask`` marks the completion's tokens, its end-of-text token included.
    """

    desirable: torch.Tensor | None = None
    """[n] bool, KTO's labels (True: desirable); None for DPO."""


def mini_batches(rows: RowsT, count: int) -> Iterator[RowsT]:
    """``count`` equal consecutive slices of ``rows`` (one optimizer step each); len(rows) must divide."""
    if len(rows) % count:
        raise ValueError(f"{len(rows)} rows do not split into {count} equal mini-batches")
    size = len(rows) // count
    for start in range(0, len(rows), size):
        yield rows.select(slice(start, start + size))


def micro_batches(rows: RowsT, size: int, max_tokens: int = 0) -> list[tuple[torch.Tensor, RowsT]]:
    """The micro-batches of ``rows`` (one forward/backward each), with the positions of their rows in ``rows``,
    as :func:`micro_batch_positions` deals them (a collective when ``max_tokens`` > 0)."""
    lengths = rows.attention_mask.sum(dim=1)
    device = rows.input_ids.device
    return [(index, rows.select(index.to(device))) for index in micro_batch_positions(lengths, size, max_tokens)]


def in_micro_batches(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    size: int,
    max_tokens: int = 0,
) -> torch.Tensor:
    """``forward(input_ids, attention_mask)`` of every row ([n, L] in, [n, ...] out, rows in their order), run
    micro-batch by micro-batch as the update deals them: the scoring passes keep the same memory bound."""
    lengths = attention_mask.sum(dim=1)
    positions = micro_batch_positions(lengths, size, max_tokens)
    parts = [forward(input_ids[i.to(input_ids.device)], attention_mask[i.to(input_ids.device)]) for i in positions]
    out = torch.cat(parts)
    return out[torch.argsort(torch.cat(positions)).to(out.device)]


def micro_batch_positions(lengths: torch.Tensor, size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """The positions (CPU index tensors) of the rows in each micro-batch, from each row's real tokens ``lengths`` [n].

    ``max_tokens`` = 0: consecutive slices of at most ``size`` rows. Otherwise token-budget micro-batches:
    each holds rows of at most ``max_tokens`` real tokens in all (prompt + response, what a packed forward
    computes), as few as fit, and EVERY rank makes as many as the rank that needs the most (one all-reduce on
    ``lengths``' device), since FSDP's collectives pair the ranks' forward passes (ranks hold equally many rows,
    so none is left with fewer rows than micro-batches). Rows are dealt longest first, each into the lightest
    micro-batch, so the micro-batches carry about the same tokens.

    Example:
        real tokens per row [9, 2, 7, 3], max_tokens=10: 21 tokens need at least 3 micro-batches; longest
        first into the lightest gives rows [0] (9 tokens), [2] (7) and [3, 1] (5), all within the budget.
    """
    if max_tokens == 0:
        return [torch.arange(s, min(s + size, len(lengths))) for s in range(0, len(lengths), size)]
    counts = lengths.tolist()
    count = torch.tensor(_fewest_bins(counts, max_tokens), device=lengths.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [torch.tensor(b, dtype=torch.long) for b in _balanced_bins(counts, int(count))]


def _balanced_bins(lengths: list[int], count: int) -> list[list[int]]:
    """Row positions dealt into ``count`` bins, longest first, each into the bin with the fewest tokens so far."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = min(range(count), key=loads.__getitem__)
        bins[lightest].append(i)
        loads[lightest] += lengths[i]
    return bins


def _fewest_bins(lengths: list[int], max_tokens: int) -> int:
    """The fewest bins for which :func:`_balanced_bins` keeps every bin within ``max_tokens``."""
    count = max(1, -(-sum(lengths) // max_tokens))
    while count < len(lengths) and any(sum(lengths[i] for i in b) > max_tokens for b in _balanced_bins(lengths, count)):
        count += 1
    return count


def global_counts(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(response tokens, sequences with at least one token) of ``response_mask`` [n, T] summed over all ranks.

    One all-reduce; the counts stay on the mask's device (0-dim float64 tensors), so no host sync.
    """
    mask = response_mask > 0
    counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)
    dist.all_reduce(counts)
    return counts[0], counts[1]
