"""Policy losses (PPO clip, GSPO, CISPO, SAPO), their registry, the clamps and NaN-safe aggregation: hand values,
loop references and the extremes (log-ratios of +-1000, NaN and inf in padding)."""

import math

import pytest
import torch
from test_algos import padded_mask, valid_positions

from rlkit.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossSettings,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    gspo_policy_loss,
    kl_estimate,
    kl_reward_penalty,
    loss_weights,
    masked_mean,
    sapo_policy_loss,
    weighted_sum,
)

CLIPS = PolicyLossSettings(clip_eps=0.2, clip_high=None, dual_clip=None, log_ratio_clamp=20.0)


def surrogate(r: float, a: float, low: float, high: float, dual: float | None) -> tuple[float, bool]:
    """PPO's per-token loss and whether a clip zeroed its gradient, by hand."""
    plain, clip = -a * r, -a * min(max(r, 1 - low), 1 + high)
    value, clipped = max(plain, clip), clip > plain
    if dual is not None and a < 0 and value > -a * dual:
        value, clipped = -a * dual, True
    return value, clipped


# -- GSPO ------------------------------------------------------------------------------------------------


def test_gspo_hand_computed_value_clip_and_gradient():
    old = torch.zeros(3, 3)
    new = torch.tensor([[0.2, -0.1, 0.5], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, 1.0, -1.0])
    loss, clipped = gspo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    s0, s1 = math.exp(0.05), math.exp(0.3)  # row 0: mean of 0.2 and -0.1 (the 0.5 is padding)
    expected = torch.tensor([[-2 * s0, -2 * s0, 0.0], [-1.2, -1.2, -1.2], [s1, s1, s1]])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    loss.sum().backward()
    # each token carries the sequence ratio's value with its own gradient: d loss_t / d logp_t = -A * s
    torch.testing.assert_close(new.grad, torch.tensor([[-2 * s0, -2 * s0, 0.0], [0.0, 0.0, 0.0], [s1, s1, s1]]))


def test_gspo_matches_loop_reference():
    gen = torch.Generator().manual_seed(20)
    new = (torch.randn(7, 6, generator=gen) * 0.3).requires_grad_(True)
    old, adv = torch.randn(7, 6, generator=gen) * 0.3, torch.randn(7, 6, generator=gen)
    mask = (torch.rand(7, 6, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0
    loss, clipped = gspo_policy_loss(new, old, adv, mask, clip_eps=0.1, clip_high=0.15, dual_clip=2.0)
    loss.sum().backward()
    for b in range(7):
        valid = [t for t in range(6) if mask[b, t] > 0]
        s = math.exp(sum(new[b, t].item() - old[b, t].item() for t in valid) / len(valid))
        for t in range(6):
            if t not in valid:
                assert loss[b, t].item() == 0.0 and clipped[b, t].item() == 0.0 and new.grad[b, t].item() == 0.0
                continue
            value, was_clipped = surrogate(s, adv[b, t].item(), 0.1, 0.15, 2.0)
            assert loss[b, t].item() == pytest.approx(value, abs=1e-5)
            assert clipped[b, t].item() == float(was_clipped)
            grad = 0.0 if was_clipped else -adv[b, t].item() * s
            assert new.grad[b, t].item() == pytest.approx(grad, abs=1e-5)


def test_gspo_token_with_seq_mean_token_mean_is_the_sequence_objective():
    gen = torch.Generator().manual_seed(21)
    old, adv = torch.randn(5, 4, generator=gen) * 0.2, torch.randn(5, generator=gen)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    new = (old + torch.randn(5, 4, generator=gen) * 0.2).requires_grad_(True)
    per_token, _ = gspo_policy_loss(new, old, adv, mask, clip_eps=0.1)
    token_form = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    (grad_token,) = torch.autograd.grad(token_form, new)
    # GSPO's own form (TRL's importance_sampling_level="sequence"): one ratio per sequence, gradient through the mean
    s = torch.exp(((new - old) * mask).sum(1) / mask.sum(1))
    sequence_form = torch.maximum(-adv * s, -adv * s.clamp(0.9, 1.1)).mean()
    (grad_seq,) = torch.autograd.grad(sequence_form, new)
    torch.testing.assert_close(token_form, sequence_form)
    torch.testing.assert_close(grad_token, grad_seq)


# -- the registry ------------------------------------------------------------------------------------------


def test_policy_loss_registry_shares_one_signature():
    gen = torch.Generator().manual_seed(22)
    new, old, adv = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen), torch.randn(4, generator=gen)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo", "sapo"}
    for name, fn in POLICY_LOSSES.items():
        loss, clipped = fn(new, old, adv, mask, CLIPS)
        assert loss.shape == clipped.shape == (4, 5), name
    loss, clipped = POLICY_LOSSES["ppo_clip"](new, old, adv, mask, CLIPS)
    ref_loss, ref_clipped = clipped_policy_loss(new, old, adv, 0.2)
    torch.testing.assert_close(loss[mask > 0], ref_loss[mask > 0])
    assert torch.equal(clipped[mask > 0], ref_clipped[mask > 0])
    assert (loss[mask == 0] == 0).all()


# -- CISPO and SAPO: the design note's hand values, loop references --------------------------------------------


def one_token(fn, new: float, old: float, advantage: float, **settings) -> tuple[float, float]:
    """A one-token loss and its gradient d loss / d logp."""
    logp = torch.tensor([[new]], requires_grad=True)
    loss, _ = fn(logp, torch.tensor([[old]]), torch.tensor([advantage]), torch.ones(1, 1), **settings)
    loss.sum().backward()
    assert logp.grad is not None
    return loss.item(), logp.grad.item()


def test_cispo_hand_values():
    half, quarter = math.log(0.5), math.log(0.25)  # r = 2 for the first three
    assert one_token(cispo_policy_loss, half, quarter, 1.0, clip_eps=0.2) == pytest.approx((0.83178, -1.2), abs=1e-5)
    # TRL's absolute cap epsilon_high = 5 (clip_eps = 1: no lower clip, clip_high = 4), and TRL's 0.2 when unset
    assert one_token(cispo_policy_loss, half, quarter, 1.0, clip_eps=1.0, clip_high=4.0) == pytest.approx(
        (1.38629, -2.0), abs=1e-5
    )
    assert one_token(cispo_policy_loss, half, quarter, 1.0, clip_eps=1.0, clip_high=-0.8) == pytest.approx(
        (0.13863, -0.2), abs=1e-5
    )
    # r = 0.5, A = -1: verl's clip_ratio_low = 10 keeps it, 0.2 lifts it to 0.8; the gradient is never zeroed
    assert one_token(cispo_policy_loss, half, 0.0, -1.0, clip_eps=10.0) == pytest.approx((-0.34657, 0.5), abs=1e-5)
    assert one_token(cispo_policy_loss, half, 0.0, -1.0, clip_eps=0.2) == pytest.approx((-0.55452, 0.8), abs=1e-5)


def test_sapo_hand_values():
    half = math.log(0.5)
    assert one_token(sapo_policy_loss, half, half, 1.0) == pytest.approx((-2.0, -1.0), abs=1e-5)
    assert one_token(sapo_policy_loss, half, math.log(0.25), 1.0) == pytest.approx((-2.92423, -1.57290), abs=1e-5)
    assert one_token(sapo_policy_loss, half, math.log(0.25), -1.0) == pytest.approx((2.82200, 1.53622), abs=1e-5)


def loop_cispo(r: float, a: float, logp: float, low: float, high: float) -> tuple[float, float, bool]:
    w = min(max(r, 1 - low), 1 + high)
    return -w * a * logp, -w * a, w != r


def loop_sapo(r: float, a: float, tau_pos: float, tau_neg: float) -> tuple[float, float]:
    tau = tau_pos if a > 0 else tau_neg
    sig = 1 / (1 + math.exp(-tau * (r - 1)))
    return -(4 / tau) * sig * a, -4 * sig * (1 - sig) * r * a


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_cispo_and_sapo_match_loop_references(name):
    gen = torch.Generator().manual_seed(23)
    new = (torch.randn(6, 5, generator=gen) * 0.5 - 1.0).requires_grad_(True)
    old, adv = new.detach() + torch.randn(6, 5, generator=gen) * 0.4, torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) < 0.75).float()
    settings = PolicyLossSettings(clip_eps=0.15, clip_high=0.3, sapo_tau_pos=0.8, sapo_tau_neg=1.3)
    loss, clipped = POLICY_LOSSES[name](new, old, adv, mask, settings)
    loss.sum().backward()
    for b in range(6):
        for t in range(5):
            if mask[b, t] == 0:
                assert loss[b, t].item() == 0.0 and new.grad[b, t].item() == 0.0
                continue
            r, a, lp = math.exp(new[b, t].item() - old[b, t].item()), adv[b, t].item(), new[b, t].item()
            if name == "cispo":
                value, grad, was_clipped = loop_cispo(r, a, lp, 0.15, 0.3)
                assert clipped[b, t].item() == float(was_clipped)
            else:
                value, grad = loop_sapo(r, a, 0.8, 1.3)
            assert loss[b, t].item() == pytest.approx(value, abs=1e-5)
            assert new.grad[b, t].item() == pytest.approx(grad, abs=1e-5)


# -- clamps at the extremes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
def test_policy_losses_survive_log_ratios_of_1000(name):
    new = torch.tensor([[1000.0, -1000.0, 1000.0, 1000.0, -1000.0]], requires_grad=True)
    adv = torch.tensor([[0.0, 0.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 5)
    if name == "gspo":  # one token per sequence, so the sequence ratio is the token's
        new, adv, mask = new.detach().reshape(5, 1).requires_grad_(True), adv.reshape(5, 1), mask.reshape(5, 1)
    loss, _ = POLICY_LOSSES[name](new, torch.zeros_like(new), adv, mask, CLIPS)
    loss.sum().backward()
    flat = loss.flatten()
    assert torch.isfinite(loss).all() and torch.isfinite(new.grad).all()
    assert flat[0].item() == 0.0 and flat[1].item() == 0.0  # zero advantage: zero loss, not NaN
    assert flat[2].item() == pytest.approx(-1.2)  # A > 0: the clip at 1 + eps
    assert flat[3].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # A < 0: the ratio stops at e^20
    assert flat[4].item() == pytest.approx(0.8)  # A < 0, ratio ~0: the clip at 1 - eps
    assert (new.grad == 0).all()  # every token is past a clip or the clamp


def test_log_ratio_clamp_is_configurable_and_stops_the_gradient():
    logp = torch.tensor([[5.0, 2.0]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]), 0.2, log_ratio_clamp=3.0)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(3.0), math.exp(2.0)]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, math.exp(2.0)]]))


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_nan_and_inf_in_padding_reach_neither_loss_nor_gradient(name):
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    new = torch.tensor([[-1.0, -2.0, math.nan, math.inf], [-0.5, -math.inf, math.nan, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -math.inf, math.nan], [-0.4, math.nan, 0.0, math.inf]])
    adv = torch.tensor([[1.0, 1.0, math.nan, math.inf], [-1.0, math.nan, 0.0, 1.0]])
    loss, clipped = POLICY_LOSSES[name](new, old, adv, mask, CLIPS)
    assert torch.isfinite(loss).all() and (loss[mask == 0] == 0).all() and (clipped[mask == 0] == 0).all()
    for mode in LOSS_AGG_MODES:
        total = aggregate_loss(loss, mask, mode)
        (grad,) = torch.autograd.grad(total, new, retain_graph=True)
        assert torch.isfinite(total), mode
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all(), mode
        assert (grad[mask > 0] != 0).all(), mode


# -- aggregation: hand values, loop reference, any split, padding dropped ----------------------------------


def test_aggregation_modes_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(2.0)  # (1+2+3)/3
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(2.25)  # (1.5+3)/2
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)  # (3+3)/2
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)  # (3+3)/(2*3)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", horizon=6).item() == pytest.approx(0.5)
    assert aggregate_loss(per_token, mask, "token-sum").item() == pytest.approx(6.0)  # 1+2+3
    with pytest.raises(ValueError, match="valid modes"):
        aggregate_loss(per_token, mask, "sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_loop_reference_and_any_split(mode):
    mask = padded_mask(10, 6, seed=12)
    mask[3] = 0.0  # an empty response counts in no mode
    per_token = torch.randn(10, 6, generator=torch.Generator().manual_seed(13))
    rows = [[per_token[b, t].item() for t in valid_positions(mask[b])] for b in range(10)]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        expected = sum(map(sum, rows)) / sum(map(len, rows))
    elif mode == "seq-mean-token-mean":
        expected = sum(sum(r) / len(r) for r in rows) / len(rows)
    elif mode == "seq-mean-token-sum":
        expected = sum(sum(r) for r in rows) / len(rows)
    elif mode == "seq-mean-token-sum-norm":
        expected = sum(sum(r) / 6 for r in rows) / len(rows)
    else:
        expected = sum(map(sum, rows))
    whole = aggregate_loss(per_token, mask, mode)
    assert whole.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    tokens, seqs = float(mask.sum()), float((mask.sum(1) > 0).sum())
    split = sum(
        weighted_sum(per_token[a:b], loss_weights(mask[a:b], mode, num_tokens=tokens, num_seqs=seqs, horizon=6))
        for a, b in ((0, 1), (1, 4), (4, 9), (9, 10))
    )
    assert split.item() == pytest.approx(whole.item(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_drops_nan_in_padding(mode):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    clean = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    dirty = torch.tensor([[1.0, 2.0, math.nan], [3.0, math.inf, -math.inf]], requires_grad=True)
    total = aggregate_loss(dirty, mask, mode)
    assert total.item() == pytest.approx(aggregate_loss(clean, mask, mode).item())
    total.backward()
    assert torch.isfinite(dirty.grad).all() and (dirty.grad[mask == 0] == 0).all()


def test_loss_weights_take_device_tensor_counts():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for mode in LOSS_AGG_MODES:
        as_floats = loss_weights(mask, mode, num_tokens=3.0, num_seqs=2.0, horizon=3)
        as_tensors = loss_weights(mask, mode, num_tokens=torch.tensor(3), num_seqs=torch.tensor(2.0), horizon=3)
        assert torch.equal(as_floats, as_tensors), mode
    assert weighted_sum(torch.tensor([[math.nan, 1.0]]), torch.tensor([[0.0, 0.5]])).item() == 0.5


def test_masked_mean_drops_nan_in_padding():
    values = torch.tensor([[1.0, math.nan], [3.0, math.inf]])
    assert masked_mean(values, torch.tensor([[1.0, 0.0], [1.0, 0.0]])).item() == pytest.approx(2.0)


# -- KL clamps ----------------------------------------------------------------------------------------------


def test_k3_clamp_caps_value_and_stops_gradient():
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[1.0, 2.0, 3.0, 1000.0, -1000.0]])  # r = logp - ref = -1, -2, -3, -1000, 1000
    kl = kl_estimate(logp, ref, "k3")
    values = [math.exp(1) - 2, math.exp(2) - 3, 10.0, 10.0, 10.0]  # e^-r - 1 + r; capped at 10 from r ~ -2.61
    torch.testing.assert_close(kl, torch.tensor([values]))
    kl.sum().backward()
    # d/dlogp (e^-r - 1 + r) = 1 - e^-r where the cap is not reached, 0 where it is
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.e, 1 - math.exp(2), 0.0, 0.0, 0.0]]))


def test_kl_clamp_is_configurable_and_unclamped_k3_stays_finite():
    logp, ref = torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 1000.0]])
    torch.testing.assert_close(kl_estimate(logp, ref, "k3", clamp=5.0), torch.tensor([[5.0, 5.0]]))
    free = kl_estimate(logp, ref, "k3", clamp=None)
    torch.testing.assert_close(free, torch.tensor([[math.exp(3) - 4, math.exp(20) - 21]]))  # exponent stops at 20
    k1 = kl_estimate(torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[-1000.0, 1000.0, 4.0]]), "k1")
    torch.testing.assert_close(k1, torch.tensor([[10.0, -10.0, -4.0]]))  # k1 is clamped to [-10, 10]


def test_kl_estimators_match_loop_reference():
    gen = torch.Generator().manual_seed(23)
    logp, ref = torch.randn(4, 6, generator=gen) * 2, torch.randn(4, 6, generator=gen) * 2
    for name in ("k1", "k2", "k3"):
        out = kl_estimate(logp, ref, name, clamp=3.0)
        for b in range(4):
            for t in range(6):
                r = logp[b, t].item() - ref[b, t].item()
                raw = {"k1": r, "k2": 0.5 * r * r, "k3": math.exp(-r) - 1 + r}[name]
                assert out[b, t].item() == pytest.approx(min(max(raw, -3.0), 3.0), abs=1e-5), name


def test_kl_reward_penalty_ignores_nan_in_padding():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_reward_penalty(
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.tensor([[-1.0, -2.0, math.nan]]),
        torch.tensor([[-1.5, -1.0, -math.inf]]),
        mask,
        coef=0.1,
        estimator="k1",
    )
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.1, 0.0]]))
