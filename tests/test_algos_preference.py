"""DPO, IPO, reference-free DPO and KTO against their closed forms on hand values, and loop references."""

import math

import pytest
import torch

from rlkit.algos import (
    dpo_loss,
    kto_kl_baseline,
    kto_loss,
    kto_metrics,
    kto_mismatched_pairs,
    kto_sums,
    preference_metrics,
    preference_sums,
)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# one pair: the policy gives the chosen answer 1 nat more than the reference, the rejected 1 nat less: h = 2
CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))


def test_dpo_sigmoid_hand_computed_with_gradient():
    chosen = CHOSEN.clone().requires_grad_(True)
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    assert losses.item() == pytest.approx(-log_sigmoid(0.2))  # -log sigmoid(beta * h) = log(1 + e^-0.2) = 0.5981
    assert losses.item() == pytest.approx(0.598139, abs=1e-6)
    assert chosen_rewards.item() == pytest.approx(0.1) and rejected_rewards.item() == pytest.approx(-0.1)
    assert not chosen_rewards.requires_grad
    losses.sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.1 * sigmoid(-0.2))  # d/d logp_w = -beta * sigmoid(-beta h)


def test_dpo_label_smoothing_is_conservative_dpo():
    losses, _, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, label_smoothing=0.1)
    assert losses.item() == pytest.approx(-0.9 * log_sigmoid(0.2) - 0.1 * log_sigmoid(-0.2))


def test_ipo_hand_computed():
    losses, _, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss="ipo")
    assert losses.item() == pytest.approx(9.0)  # (h - 1 / (2 beta))^2 = (2 - 5)^2
    at_target, _, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.25, loss="ipo")
    assert at_target.item() == pytest.approx(0.0)  # h = 1 / (2 * 0.25): IPO's fixed point
    with pytest.raises(ValueError, match='label_smoothing=0.1 applies to loss="sigmoid" only'):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="valid DPO losses"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss="hinge")


def test_reference_free_dpo_uses_the_policy_log_probs_alone():
    losses, chosen_rewards, rejected_rewards = dpo_loss(CHOSEN, REJECTED, None, None, beta=0.1, reference_free=True)
    assert losses.item() == pytest.approx(-log_sigmoid(0.1 * (-10.0 + 12.0)))
    assert chosen_rewards.item() == pytest.approx(-1.0) and rejected_rewards.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="needs the reference log-probs unless reference_free=True"):
        dpo_loss(CHOSEN, REJECTED, None, None, beta=0.1)


def test_dpo_matches_loop_reference_and_metrics():
    gen = torch.Generator().manual_seed(40)
    c, r, rc, rr = (torch.randn(9, generator=gen) * 3 - 20 for _ in range(4))
    losses, chosen_rewards, rejected_rewards = dpo_loss(c, r, rc, rr, beta=0.5, label_smoothing=0.05)
    wins = 0
    for i in range(9):
        h = (c[i] - rc[i]).item() - (r[i] - rr[i]).item()
        expected = -0.95 * log_sigmoid(0.5 * h) - 0.05 * log_sigmoid(-0.5 * h)
        assert losses[i].item() == pytest.approx(expected, abs=1e-5)
        wins += h > 0
    m = preference_metrics(chosen_rewards, rejected_rewards)
    assert m["rewards/chosen"] == pytest.approx(0.5 * (c - rc).mean().item(), abs=1e-5)
    assert m["rewards/rejected"] == pytest.approx(0.5 * (r - rr).mean().item(), abs=1e-5)
    assert m["rewards/margins"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-5)
    assert m["rewards/accuracy"] == pytest.approx(wins / 9)


# -- KTO ---------------------------------------------------------------------------------------------------------


def test_kto_kl_baseline_and_mismatched_pairs():
    assert kto_mismatched_pairs(4).tolist() == [3, 0, 1, 2]  # prompt i with completion i - 1
    with pytest.raises(ValueError, match=">= 2 examples"):
        kto_mismatched_pairs(1)
    logps = torch.tensor([-5.0, -6.0, -7.0], requires_grad=True)
    z = kto_kl_baseline(logps, torch.tensor([-5.5, -6.5, -6.0]))  # log-ratios 0.5, 0.5, -1: mean 0
    assert z.item() == pytest.approx(0.0) and not z.requires_grad
    assert kto_kl_baseline(torch.tensor([-5.0, -6.0]), torch.tensor([-6.0, -6.5])).item() == pytest.approx(0.75)
    assert kto_kl_baseline(torch.tensor([-7.0]), torch.tensor([-6.0])).item() == 0.0  # max(0, -1)


def test_kto_hand_computed_with_gradient():
    logps = torch.tensor([-5.0, -7.0, -6.0], requires_grad=True)
    ref = torch.tensor([-6.0, -6.0, -6.5])  # log-ratios r = 1, -1, 0.5
    desirable = torch.tensor([True, False, False])
    losses, rewards = kto_loss(logps, ref, desirable, 0.5, beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    expected = [
        1 - sigmoid(0.1 * (1 - 0.5)),  # desirable: 1 - sigmoid(beta (r - z))
        2.0 * (1 - sigmoid(0.1 * (0.5 + 1))),  # undesirable: w_U (1 - sigmoid(beta (z - r)))
        2.0 * (1 - sigmoid(0.0)),  # r = z: halfway, 0.5 * w_U
    ]
    torch.testing.assert_close(losses, torch.tensor(expected))
    torch.testing.assert_close(rewards, torch.tensor([0.1, -0.1, 0.05]))
    losses.sum().backward()
    s = sigmoid(0.05)  # d/dr [1 - sigmoid(beta (r - z))] = -beta sigmoid (1 - sigmoid)
    assert logps.grad[0].item() == pytest.approx(-0.1 * s * (1 - s))
    m = kto_metrics(rewards, desirable, 0.5, beta=0.1)
    assert m["rewards/chosen"] == pytest.approx(0.1) and m["rewards/rejected"] == pytest.approx(-0.025)
    assert m["rewards/margins"] == pytest.approx(0.125)
    # beta * z = 0.05: the desirable 0.1 is above (right), the undesirable -0.1 below (right), 0.05 is not below
    assert m["rewards/accuracy"] == pytest.approx(2 / 3) and m["kto/z_ref"] == 0.5
    assert math.isnan(kto_metrics(rewards, torch.ones(3, dtype=torch.bool), 0.5, beta=0.1)["rewards/rejected"])


def test_kto_matches_loop_reference():
    gen = torch.Generator().manual_seed(41)
    logps, ref = torch.randn(12, generator=gen) * 2 - 10, torch.randn(12, generator=gen) * 2 - 10
    desirable = torch.rand(12, generator=gen) < 0.5
    losses, _ = kto_loss(logps, ref, desirable, 0.3, beta=0.2, desirable_weight=1.5, undesirable_weight=0.7)
    for i in range(12):
        r = logps[i].item() - ref[i].item()
        if desirable[i]:
            expected = 1.5 * (1 - sigmoid(0.2 * (r - 0.3)))
        else:
            expected = 0.7 * (1 - sigmoid(0.2 * (0.3 - r)))
        assert losses[i].item() == pytest.approx(expected, abs=1e-6)


def test_metric_sums_of_parts_add_up_to_the_whole_batch():
    """Micro-batches and ranks add their sums and counts: [0.3, -0.2 | 0.1] must give the means of all three."""
    chosen, rejected = torch.tensor([0.3, -0.2, 0.1]), torch.tensor([0.1, 0.0, 0.4])
    parts = [preference_sums(chosen[:2], rejected[:2]), preference_sums(chosen[2:], rejected[2:])]
    whole = preference_metrics(chosen, rejected)
    for name, mean in whole.items():
        assert float(sum(p[name].total for p in parts) / sum(p[name].count for p in parts)) == pytest.approx(mean)
    assert whole["rewards/accuracy"] == pytest.approx(1 / 3)  # only 0.3 > 0.1
    rewards, desirable = torch.tensor([0.2, -0.4, 0.1, 0.6]), torch.tensor([True, False, False, True])
    sums = kto_sums(rewards, desirable, 1.0, beta=0.1)  # the baseline point beta * z_ref = 0.1
    assert (float(sums["rewards/chosen"].total), int(sums["rewards/chosen"].count)) == pytest.approx((0.8, 2))
    assert (float(sums["rewards/rejected"].total), int(sums["rewards/rejected"].count)) == pytest.approx((-0.3, 2))
    assert float(sums["rewards/accuracy"].total) == 3  # 0.2 > 0.1, -0.4 < 0.1, 0.6 > 0.1; 0.1 is not below 0.1
