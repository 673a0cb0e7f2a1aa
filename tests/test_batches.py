"""The rows a role trains on and how they are cut into mini- and micro-batches (token budgets on 2 gloo ranks)."""

import pytest
import torch

from rlkit.workers.batches import PolicyRows, _balanced_bins, _fewest_bins, micro_batches, mini_batches


def rows_of(lengths: list[int], width: int = 12) -> PolicyRows:
    """Rows whose real (attended) token counts are ``lengths``; the last 4 columns are the response."""
    n = len(lengths)
    attention = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(lengths):
        attention[i, width - length :] = 1  # left padding only: the response part is full
    return PolicyRows(
        input_ids=torch.arange(n * width).view(n, width),
        attention_mask=attention,
        response_mask=torch.ones(n, 4),
        advantages=torch.arange(n, dtype=torch.float32)[:, None].expand(n, 4).clone(),
    )


def test_balanced_bins_by_hand():
    assert _fewest_bins([9, 2, 7, 3], 10) == 3
    assert _balanced_bins([9, 2, 7, 3], 3) == [[0], [2], [3, 1]]
    assert _fewest_bins([5, 5, 5, 5], 10) == 2 and _balanced_bins([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert _fewest_bins([6, 6, 6], 10) == 3  # no two rows fit together
    assert _fewest_bins([6, 6, 6], 100) == 1


def test_mini_batches_split_evenly_and_refuse_a_remainder():
    rows = rows_of([5] * 6)
    assert [len(m) for m in mini_batches(rows, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="6 rows do not split into 4"):
        list(mini_batches(rows, 4))


def cut_on_rank(budget: int) -> list[list[int]]:
    """On a worker: rank 0 holds long rows, rank 1 short ones; the token-budget micro-batches' row positions."""
    from rlkit.runtime import context

    lengths = [12, 11, 10, 12, 9, 12] if context().rank == 0 else [5, 6, 5, 5, 6, 5]
    cut = micro_batches(rows_of(lengths), size=64, max_tokens=budget)
    for index, micro in cut:  # each micro-batch holds the rows it names
        assert torch.equal(micro.input_ids, rows_of(lengths).input_ids[index])
    return [index.tolist() for index, _ in cut] + [[int(micro.attention_mask.sum()) for _, micro in cut]]


def test_token_budget_micro_batches_pair_up_across_ranks(cluster):
    first, second = cluster.run(cut_on_rank, 24)
    *bins0, tokens0 = first
    *bins1, tokens1 = second
    # rank 0: 66 tokens need 3 micro-batches of <= 24 (12+11, 12+10, 12+9); rank 1 (32 tokens) alone would need 2
    assert len(bins0) == len(bins1) == 3, "every rank makes as many micro-batches as the rank that needs the most"
    for bins in (bins0, bins1):
        assert sorted(i for b in bins for i in b) == list(range(6)), "every row exactly once"
    assert tokens0 == [23, 22, 21] and tokens1 == [11, 11, 10], "longest first into the lightest"
