"""RL math against hand-computed values and loop references."""

import math

import pytest
import torch

from rlkit.algos import clipped_policy_loss, grpo_advantages, kl_estimate, masked_mean


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = grpo_advantages(rewards, 4, eps=0.0)
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


# -- helpers for loop references -------------------------------------------------------------------


def padded_mask(b: int, t: int, seed: int, holes: bool = False) -> torch.Tensor:
    """[b, t] right-padded response mask with random lengths in 1..t; with holes, some interior zeros too."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    if holes:
        interior = (torch.rand(b, t, generator=gen) < 0.3) & (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1) - 1)
        interior[:, 0] = False
        mask[interior] = 0.0
    return mask


def valid_positions(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(len(mask_row)) if mask_row[t] > 0]


# -- token rewards, group estimators -----------------------------------------------------------------


def test_outcome_token_rewards_land_on_the_last_token():
    from rlkit.algos import outcome_token_rewards

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 0.5]), mask)
    expected = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    torch.testing.assert_close(out, expected)


def test_rloo_hand_computed_and_loop_reference():
    from rlkit.algos import rloo_advantages

    # group [1, 0, 2]: the others' means are 1, 1.5, 0.5
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 0.0, 2.0]), 3), torch.tensor([0.0, -1.5, 1.5]))
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(3))
    adv = rloo_advantages(rewards, 6)
    for i in range(24):
        g = i // 6
        others = [rewards[j].item() for j in range(g * 6, g * 6 + 6) if j != i]
        assert adv[i].item() == pytest.approx(rewards[i].item() - sum(others) / 5, abs=1e-6)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.ones(3), 1)


# -- token-level estimators ----------------------------------------------------------------------------


def test_discounted_returns_hand_computed():
    from rlkit.algos import discounted_returns

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0], [1.0, 9.0, 2.0, 9.0]])  # 9s sit on masked positions
    expected = torch.tensor([[0.25, 0.5, 1.0, 0.0], [2.0, 0.0, 2.0, 0.0]])  # the hole is skipped: 1 + 0.5 * 2
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), expected)


def test_discounted_returns_match_loop_reference_with_padding():
    from rlkit.algos import discounted_returns

    mask = padded_mask(9, 7, seed=4, holes=True)
    rewards = torch.randn(9, 7, generator=torch.Generator().manual_seed(5))
    out = discounted_returns(rewards, mask, 0.9)
    for b in range(9):
        running = 0.0
        for t in reversed(valid_positions(mask[b])):
            running = rewards[b, t].item() + 0.9 * running
            assert out[b, t].item() == pytest.approx(running, abs=1e-5)
    assert (out[mask == 0] == 0).all()


def test_gae_hand_computed():
    from rlkit.algos import gae_advantages

    rewards, values, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3)
    # gamma = lam = 1: A_t = sum of future rewards - V_t = 1 - V_t; returns are 1 everywhere
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.2]]))
    torch.testing.assert_close(ret, torch.ones(1, 3))
    # gamma 0.9, lam 0.5: deltas 0.04, 0.12, 0.2; A2 = 0.2, A1 = 0.12 + 0.45 * 0.2, A0 = 0.04 + 0.45 * A1
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.1345, 0.21, 0.2]]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_matches_loop_reference_with_padding():
    from rlkit.algos import gae_advantages

    gen = torch.Generator().manual_seed(6)
    mask = padded_mask(8, 9, seed=7, holes=True)
    rewards, values = torch.randn(8, 9, generator=gen), torch.randn(8, 9, generator=gen)  # garbage on padding
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for b in range(8):
        steps = valid_positions(mask[b])
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b, t].item() + 0.95 * next_value - values[b, t].item()
            next_adv = delta + 0.95 * 0.9 * next_adv
            next_value = values[b, t].item()
            assert adv[b, t].item() == pytest.approx(next_adv, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(next_adv + values[b, t].item(), abs=1e-5)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_masked_whiten_matches_loop_reference():
    from rlkit.algos import masked_whiten

    mask = padded_mask(5, 6, seed=8)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(9))
    vals = [x[b, t].item() for b in range(5) for t in range(6) if mask[b, t] > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    out = masked_whiten(x, mask)
    for b in range(5):
        for t in range(6):
            expected = (x[b, t].item() - mean) / std if mask[b, t] > 0 else 0.0
            assert out[b, t].item() == pytest.approx(expected, abs=1e-5)


# -- the registry --------------------------------------------------------------------------------------


def inputs(**kw):
    from rlkit.algos import AdvantageInputs

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.5, 0.5, 0.0]])
    return AdvantageInputs(token_rewards=rewards, response_mask=mask, group_size=2, **kw)


def test_registry_sequence_estimators_broadcast_over_tokens():
    from rlkit.algos import ADVANTAGE_ESTIMATORS, compute_advantages

    x = inputs()
    assert x.scores.tolist() == [1.0, 0.0, 3.0, 1.0]
    for name, per_seq in (
        ("grpo", grpo_advantages(x.scores, 2)),
        ("drgrpo", torch.tensor([0.5, -0.5, 1.0, -1.0])),
        ("rloo", torch.tensor([1.0, -1.0, 2.0, -2.0])),
    ):
        adv, ret = compute_advantages(name, x)
        torch.testing.assert_close(adv, per_seq.unsqueeze(1) * x.response_mask, msg=name)
        assert torch.equal(ret, adv)
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce++-baseline", "reinforce++", "gae"}


def test_registry_token_estimators_whiten():
    from rlkit.algos import compute_advantages, discounted_returns, gae_advantages, masked_whiten

    x = inputs(gamma=0.9)
    adv, ret = compute_advantages("reinforce++", x)
    torch.testing.assert_close(ret, discounted_returns(x.token_rewards, x.response_mask, 0.9))
    torch.testing.assert_close(adv, masked_whiten(ret, x.response_mask))
    valid = adv[x.response_mask > 0]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6) and valid.std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("gae", x)
    values = torch.full((4, 3), 0.3)
    adv, ret = compute_advantages("gae", inputs(values=values, gamma=1.0, lam=0.95))
    raw, expected_ret = gae_advantages(x.token_rewards, values, x.response_mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(ret, expected_ret)
    torch.testing.assert_close(adv, masked_whiten(raw, x.response_mask))


def test_custom_estimator_is_checked_and_named():
    from rlkit.algos import compute_advantages

    def flat(x):
        return x.scores, x.scores  # [B], not [B, T]

    with pytest.raises(ValueError, match=r"'flat' must return \(advantages, returns\)"):
        compute_advantages(flat, inputs())

    def nan_for_two(x):
        adv = x.token_rewards.clone()
        adv[2, 1] = float("nan")
        return adv, adv

    with pytest.raises(ValueError, match=r"'nan_for_two' returned non-finite advantages for sample\(s\) \[2\]"):
        compute_advantages(nan_for_two, inputs())

    def nan_on_padding(x):
        adv = x.token_rewards.clone()
        adv[1, 2] = float("nan")  # masked out: ignored and zeroed
        return adv, adv

    adv, _ = compute_advantages(nan_on_padding, inputs())
    assert adv[1, 2].item() == 0.0


# -- losses --------------------------------------------------------------------------------------------


def test_clip_higher_is_asymmetric():
    ratios = torch.tensor([[1.25, 1.25, 0.75, 1.4]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, clipped = clipped_policy_loss(ratios.log(), torch.zeros(1, 4), adv, 0.2, clip_high=0.28)
    # 1.25 < 1.28 is inside the upper clip; 0.75 < 0.8 is clipped from below for A < 0; 1.4 clips to 1.28
    torch.testing.assert_close(loss, torch.tensor([[-1.25, 1.25, 0.8, -1.28]]))
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))


def test_dual_clip_caps_negative_advantages():
    logp = torch.tensor([[5.0, 2.0, 5.0, 5.0]]).log().requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    loss, clipped = clipped_policy_loss(logp, torch.zeros(1, 4), adv, 0.2, dual_clip=3.0)
    # A=-1, r=5: max(5, 1.2) = 5 capped at 3; r=2: 2 < 3 stays; A=+1: the ordinary clip, -1.2; A=-2, r=5: 10 -> 6
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2, 6.0]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]]))  # d(-A r)/dlogp = -A r = 2


def test_policy_loss_vectorised_matches_loop_reference():
    gen = torch.Generator().manual_seed(10)
    logp, old = torch.randn(6, 5, generator=gen) * 0.5, torch.randn(6, 5, generator=gen) * 0.5
    adv = torch.randn(6, 5, generator=gen)
    loss, clipped = clipped_policy_loss(logp, old, adv, 0.2, clip_high=0.3, dual_clip=2.0)
    for b in range(6):
        for t in range(5):
            r, a = math.exp(logp[b, t].item() - old[b, t].item()), adv[b, t].item()
            surrogate = max(-a * r, -a * min(max(r, 0.8), 1.3))
            value = min(surrogate, -a * 2.0) if a < 0 else surrogate
            assert loss[b, t].item() == pytest.approx(value, abs=1e-5)
            was_clipped = (-a * min(max(r, 0.8), 1.3) > -a * r) or (a < 0 and surrogate > -a * 2.0)
            assert clipped[b, t].item() == float(was_clipped)


def test_clipped_value_loss_hand_computed():
    from rlkit.algos import clipped_value_loss

    values, old, returns = (
        torch.tensor([[1.5, 1.1, 0.5]]),
        torch.tensor([[1.0, 1.0, 1.0]]),
        torch.tensor([[2.0, 2.0, 0.0]]),
    )
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # V=1.5 moves past 1.2: (1.2-2)^2 = 0.64 > 0.25; V=1.1 is inside; V=0.5 clips to 0.8: 0.64 > 0.25
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.405, 0.32]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 0.0, 1.0]]))
    plain, none = clipped_value_loss(values, old, returns, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.125, 0.405, 0.125]]))
    assert none.sum() == 0


def test_entropy_hand_computed_and_loop_reference():
    from rlkit.algos import entropy_from_logits

    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    logits = torch.randn(3, 2, 7, generator=torch.Generator().manual_seed(11))
    out = entropy_from_logits(logits)
    for b in range(3):
        for t in range(2):
            z = [math.exp(v) for v in logits[b, t].tolist()]
            p = [v / sum(z) for v in z]
            assert out[b, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-5)


def test_kl_reward_penalty_and_explained_variance():
    from rlkit.algos import explained_variance, kl_reward_penalty

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_reward_penalty(
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.tensor([[-1.0, -2.0, -3.0]]),
        torch.tensor([[-1.5, -1.0, -1.0]]),
        mask,
        coef=0.1,
        estimator="k1",
    )
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.1, 0.0]]))
    returns = torch.tensor([[1.0, 3.0, 99.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 3), returns, mask) == pytest.approx(0.0)
    # residuals [0.5, -0.5] (var 0.25) against returns [1, 3] (var 1)
    assert explained_variance(torch.tensor([[0.5, 3.5, 0.0]]), returns, mask) == pytest.approx(0.75)
