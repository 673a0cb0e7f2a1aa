"""Validation math: pass@k (Chen et al. 2021) against hand values and subset enumeration, and the val/ metrics."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlkit.data.evaluation import pass_at_k, pass_ks, validation_metrics


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [(4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (4, 0, 3, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (5, 1, 4, 0.8), (3, 1, 3, 1.0)],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_hit():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_reported_ks():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


def test_validation_metrics_by_hand():
    group = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    correct = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    brevity = torch.tensor([0.5, 0.1, 0.2, 0.0, 0.3, 0.3, 0.1, 0.1])
    total = correct + 2 * brevity
    m = validation_metrics(total, {"correct": correct, "brevity": brevity}, group)
    assert m == pytest.approx({
        "val/prompts": 2.0,
        "val/samples": 8.0,
        "val/reward/mean": total.mean().item(),
        "val/reward/correct/mean": 0.375,
        "val/reward/correct/pass@1": 0.375,
        "val/reward/correct/pass@2": (0.5 + 5 / 6) / 2,
        "val/reward/correct/pass@4": 1.0,
        "val/reward/brevity/mean": brevity.mean().item(),
    })


def test_binary_total_gets_pass_at_k_and_uneven_groups_are_refused():
    m = validation_metrics(torch.tensor([0.0, 1.0]), {"c": torch.tensor([0.0, 1.0])}, torch.tensor([0, 0]))
    assert m["val/reward/pass@2"] == 1.0 and m["val/reward/pass@1"] == 0.5
    with pytest.raises(ValueError, match="same number of samples"):
        validation_metrics(torch.ones(3), {}, torch.tensor([0, 0, 1]))


def test_a_term_that_returned_none_is_averaged_over_the_samples_it_scored():
    terms = {"math": torch.tensor([1.0, float("nan"), 0.0, float("nan")])}
    out = validation_metrics(torch.tensor([1.0, 0.0, 0.0, 0.0]), terms, torch.tensor([0, 0, 1, 1]))
    assert out["val/reward/math/mean"] == 0.5 and "val/reward/math/pass@1" not in out
    assert out["val/reward/pass@2"] == 0.5
