"""RL math against hand-computed values and loop references."""

import math

import pytest
import torch

from rlkit.algos import clipped_policy_loss, grpo_advantages, kl_estimate, masked_mean


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = grpo_advantages(rewards, group_size=4, eps=0.0)
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    s = math.sqrt(1 / 3)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])
    torch.testing.assert_close(adv, expected)


def test_grpo_advantages_unscaled_is_mean_centred():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0])
    torch.testing.assert_close(grpo_advantages(rewards, 2, scale=False), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_grpo_equal_rewards_give_zero():
    assert torch.equal(grpo_advantages(torch.ones(6), 3), torch.zeros(6))


def test_grpo_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=gen)
    adv = grpo_advantages(rewards, 8)
    for g in range(5):
        group = rewards[g * 8 : (g + 1) * 8].tolist()
        mean = sum(group) / 8
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 7)
        for i, r in enumerate(group):
            assert adv[g * 8 + i].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-5)


def test_grpo_rejects_partial_group():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        grpo_advantages(torch.ones(6), 4)


def test_clipped_policy_loss_hand_computed():
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, clipped = clipped_policy_loss(ratios.log(), old, adv, clip_eps=0.2)
    # max(-A r, -A clip(r, 0.8, 1.2)) per token
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, -0.5, 0.8]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


def test_clipped_policy_loss_broadcasts_sequence_advantages():
    logp = torch.tensor([[0.1, -0.1], [0.0, 0.2]])
    per_seq, _ = clipped_policy_loss(logp, torch.zeros(2, 2), torch.tensor([2.0, -1.0]), 0.2)
    per_tok, _ = clipped_policy_loss(logp, torch.zeros(2, 2), torch.tensor([[2.0, 2.0], [-1.0, -1.0]]), 0.2)
    assert torch.equal(per_seq, per_tok)


def test_policy_gradient_at_ratio_one_is_minus_advantage():
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 3), torch.tensor([[2.0, -1.0, 0.5]]), 0.2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 1.0, -0.5]]))


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    r = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(r)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * r * r)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + r)
    with pytest.raises(ValueError, match="valid estimators"):
        kl_estimate(logp, ref, "k4")


def test_masked_mean():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
