"""Rollout correction (rlkit.algos.correction) and its place in the actor's objective: the hand-computed cases of
the design note (checked against verl's code and TRL's and OpenRLHF's formulas), loop references, and the pitfalls
(NaN and -inf engine log-probs, padding, empty masks, long sequences, detached weights)."""

import math

import pytest
import torch

from rlkit.algos import (
    Correction,
    PolicyLossSettings,
    PolicyObjective,
    aggregate_loss,
    correction_weights,
    engine_log_ratio,
    level_log_ratio,
    loss_weights,
    mismatch_metrics,
    mismatch_summary,
    policy_objective,
    rejection_keep,
    truncated_weights,
)

LN = math.log


def delta_of(*values: float, mask: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's delta = l_o - l_e and checked, from its deltas (engine log-prob 0, trainer's = delta)."""
    old = torch.tensor([values])
    response_mask = torch.tensor([mask or [1.0] * len(values)])
    return engine_log_ratio(old, torch.zeros_like(old), response_mask)


def weights(delta: torch.Tensor, checked: torch.Tensor, **settings) -> list[float]:
    return correction_weights(delta, checked, Correction(**settings)).weights[0].tolist()


# -- the design note's table, row by row ---------------------------------------------------------------------


def test_token_tis_truncates_at_the_cap_and_zeroes_padding():
    assert weights(*delta_of(LN(3), 0.0, LN(0.25)), weight="token", weight_cap=2.0) == pytest.approx([2, 1, 0.25])
    got = weights(*delta_of(LN(0.5), LN(2), 30.0, mask=[1, 1, 0]), weight="token", weight_cap=2.0)
    assert got == pytest.approx([0.5, 2.0, 0.0])


def test_two_sided_token_tis():
    got = weights(*delta_of(LN(0.25), 0.0, LN(8)), weight="token", weight_cap=5.0, weight_floor=0.5)
    assert got == pytest.approx([0.5, 1.0, 5.0])


def test_sequence_product_weights():
    assert weights(*delta_of(LN(2), LN(2), 0.0), weight="sequence", weight_cap=2.0) == pytest.approx([2, 2, 2])
    assert weights(*delta_of(LN(2), LN(0.5), LN(1.5)), weight="sequence", weight_cap=2.0) == pytest.approx([1.5] * 3)
    # a NaN engine log-prob in padding: the sequence's product and its weights ignore it
    old = torch.tensor([[LN(0.5), LN(0.5), 0.0]])
    delta, checked = engine_log_ratio(old, torch.tensor([[0.0, 0.0, math.nan]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert weights(delta, checked, weight="sequence", weight_cap=2.0) == pytest.approx([0.25, 0.25, 0.0])


def test_product_and_geometric_mean_are_both_offered():
    delta, checked = delta_of(LN(4), 0.0)
    assert level_log_ratio(delta, checked, "sequence").exp()[0, 0].item() == pytest.approx(4.0)
    assert level_log_ratio(delta, checked, "geometric").exp()[0, 0].item() == pytest.approx(2.0)
    long_delta, long_checked = delta_of(*[0.012] * 100)  # TRL #4772: the product grows with length
    assert level_log_ratio(long_delta, long_checked, "sequence").exp()[0, 0].item() == pytest.approx(3.3201, abs=1e-4)
    assert level_log_ratio(long_delta, long_checked, "geometric").exp()[0, 0].item() == pytest.approx(1.01207, abs=1e-5)


def test_token_mask_icepop():
    settings = dict(weight="token", weight_cap=None, mask="token", mask_low=0.5, mask_high=2.0)
    delta, checked = delta_of(LN(0.4), LN(1.5), LN(2.5))
    result = correction_weights(delta, checked, Correction(**settings))
    assert result.weights[0].tolist() == pytest.approx([0.0, 1.5, 0.0])
    assert result.rejected.float().mean().item() == pytest.approx(2 / 3)
    # the band's edges are kept
    assert weights(*delta_of(LN(0.5), LN(2), 0.0), **settings) == pytest.approx([0.5, 2.0, 1.0])


def test_token_mask_zeroes_the_weight_and_keeps_the_normaliser():
    """rho = [4, 1, 1], r = A = 1, token-mean: zeroing the weight gives -2/3 (TRL, OpenRLHF, NeMo-RL); verl's
    shrinking of the loss mask would give -1."""
    delta, checked = delta_of(LN(4), 0.0, 0.0)
    mask = torch.ones(1, 3)
    objective = PolicyObjective(correction=Correction(mask="token", mask_low=0.5, mask_high=2.0))
    new = torch.zeros(1, 3, requires_grad=True)
    agg = loss_weights(mask, "token-mean", num_tokens=3, num_seqs=1, horizon=3)
    rollout = -delta  # engine log-probs, with the trainer's old ones at 0
    old, advantages = torch.zeros(1, 3), torch.ones(1)
    loss, metrics = policy_objective(new, old, advantages, mask, agg, objective, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-2 / 3)
    kept = rejection_keep(delta, checked, "token", low=0.5, high=2.0).float()
    shrunk = aggregate_loss(torch.full((1, 3), -1.0), kept, "token-mean")
    assert shrunk.item() == pytest.approx(-1.0)
    masked = metrics["rollout_correction/masked_frac"]
    assert float(masked.total) / float(masked.count) == pytest.approx(1 / 3)


def test_sequence_mask_on_the_product_and_the_geometric_mean():
    trl = dict(weight="sequence", weight_cap=None, mask="sequence", mask_low=0.0, mask_high=3.0)  # TRL sequence_mask
    assert weights(*delta_of(LN(2), LN(2)), **trl) == pytest.approx([0.0, 0.0])
    assert weights(*delta_of(LN(2), LN(0.75)), **trl) == pytest.approx([1.5, 1.5])
    long_delta, long_checked = delta_of(*[0.012] * 100)
    assert max(weights(long_delta, long_checked, **trl)) == 0.0  # product 3.32 > 3
    geo = correction_weights(long_delta, long_checked, Correction(mask="geometric", mask_low=0.5, mask_high=2.0))
    assert geo.weights.min().item() == 1.0 and not geo.rejected.any()  # geometric mean 1.012 is kept


def ppo_case(engine: float, old: float, new: float, advantage: float, **correction) -> tuple[float, float]:
    """The note's decoupled-PPO token: loss and d loss / d logp with eps 0.2 and dual-clip 3."""
    settings = PolicyLossSettings(clip_eps=0.2, dual_clip=3.0)
    objective = PolicyObjective(loss=settings, correction=Correction(**correction))
    logp = torch.tensor([[LN(new)]], requires_grad=True)
    mask = torch.ones(1, 1)
    loss, _ = policy_objective(logp, torch.tensor([[LN(old)]]), torch.tensor([advantage]), mask, mask, objective,
                               rollout_logprobs=torch.tensor([[LN(engine)]]))  # fmt: skip
    loss.backward()
    assert logp.grad is not None
    return loss.item(), logp.grad.item()


def test_decoupled_ppo_with_token_tis():
    # engine 0.1, trainer 0.3 (rho = 3, w = 2), new 0.45 (r = 1.5)
    assert ppo_case(0.1, 0.3, 0.45, 1.0, weight="token", weight_cap=2.0) == pytest.approx((-2.4, 0.0))
    assert ppo_case(0.1, 0.3, 0.45, -1.0, weight="token", weight_cap=2.0) == pytest.approx((3.0, 3.0))


def test_bypass_takes_the_engine_as_the_old_policy():
    # r = 0.45 / 0.1 = 4.5: clipped at 1.2 for A > 0, dual-clipped at 3 for A < 0; no weight
    assert ppo_case(0.1, 0.3, 0.45, 1.0, bypass=True) == pytest.approx((-1.2, 0.0))
    assert ppo_case(0.1, 0.3, 0.45, -1.0, bypass=True) == pytest.approx((3.0, 0.0))


def test_mismatch_metrics_hand_values():
    old = torch.tensor([[LN(2), 0.0, LN(0.5), 7.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, math.nan]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    summary = mismatch_summary(old, rollout, mask)
    expected = {"kl_k1": 0.0, "kl_k3": 1 / 6, "chi2": 0.75, "mult_prob_error": 5 / 3, "abs_delta_mean": 0.46210,
                "ess": 7 / 9, "ratio_max": 2.0, "ratio_min": 0.5, "tokens": 3}  # fmt: skip
    for name, value in expected.items():
        assert summary[name] == pytest.approx(value, abs=1e-5), name
    delta, checked = engine_log_ratio(old, rollout, mask)
    step = mismatch_metrics(delta, checked)
    assert float(step["mismatch/kl_k3"].total) / float(step["mismatch/kl_k3"].count) == pytest.approx(1 / 6)
    assert float(step["mismatch/abs_delta/max"].value) == pytest.approx(LN(2))
    assert float(step["mismatch/ratio/min"].value) == pytest.approx(0.5)
    assert step["mismatch/kl_k3"].per_rank and not step["mismatch/ratio/mean"].per_rank


def test_k3_and_chi2_clamp_the_log_ratio_like_every_other_exp():
    """A token 100 nats apart (an engine -inf turned finite, a stale sync) must not make k3 and chi2 inf."""
    old, rollout, mask = torch.tensor([[100.0, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    summary = mismatch_summary(old, rollout, mask)
    delta, checked = engine_log_ratio(old, rollout, mask)
    step = mismatch_metrics(delta, checked)
    k3, chi2 = (math.exp(20) - 21) / 2, (math.exp(40) - 1) / 2
    assert summary["kl_k3"] == pytest.approx(k3) and summary["chi2"] == pytest.approx(chi2)
    assert float(step["mismatch/kl_k3"].total) / 2 == pytest.approx(k3)
    assert float(step["mismatch/chi2"].total) / 2 == pytest.approx(chi2)
    assert summary["kl_k1"] == -50.0 and summary["abs_delta_max"] == 100.0  # the raw gap


# -- loop references and the pitfalls ------------------------------------------------------------------------


def loop_weight(deltas: list[float], mask: list[bool], c: Correction) -> list[float]:
    """One row's weights by hand: Python floats, one token at a time."""
    kept = [d for d, m in zip(deltas, mask, strict=True) if m]
    level_value = {
        "token": None,
        "sequence": sum(kept),
        "geometric": sum(kept) / max(len(kept), 1),
    }
    out = []
    for d, m in zip(deltas, mask, strict=True):
        if not m:
            out.append(0.0)
            continue
        w = 1.0
        if c.weight != "none":
            log = d if c.weight == "token" else level_value[c.weight]
            w = min(max(math.exp(max(-20.0, min(20.0, log))), c.weight_floor), c.weight_cap or math.inf)
        if c.mask != "none":
            log = d if c.mask == "token" else level_value[c.mask]
            ratio = math.exp(log)
            w = w if c.mask_low <= ratio <= c.mask_high else 0.0
        out.append(w)
    return out


@pytest.mark.parametrize(
    "correction",
    [
        Correction(weight="token", weight_cap=2.0),
        Correction(weight="token", weight_cap=3.0, weight_floor=0.5),
        Correction(weight="sequence", weight_cap=2.5),
        Correction(weight="geometric", weight_cap=None),
        Correction(weight="token", weight_cap=5.0, mask="token", mask_low=0.5, mask_high=5.0),
        Correction(weight="sequence", weight_cap=None, mask="sequence", mask_low=0.0, mask_high=3.0),
        Correction(weight="token", weight_cap=None, mask="geometric", mask_low=0.8, mask_high=1.25),
    ],
    ids=["tis", "tis-two-sided", "seq-product", "seq-geometric", "icepop", "trl-sequence-mask", "seq-mask-tis"],
)
def test_weights_match_a_loop_reference(correction):
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(9, 7, generator=gen) * 0.4 - 2.0
    rollout = old - torch.randn(9, 7, generator=gen) * 0.4
    mask = (torch.rand(9, 7, generator=gen) < 0.8).float()
    mask[0] = 0.0  # an empty row
    rollout[1] = math.nan  # a row the engine returned no log-probs for
    delta, checked = engine_log_ratio(old, rollout, mask)
    got = correction_weights(delta, checked, correction).weights
    for b in range(9):
        deltas = (old[b] - rollout[b]).tolist()
        flags = [bool(m) and math.isfinite(d) for m, d in zip(mask[b].tolist(), deltas, strict=True)]
        assert got[b].tolist() == pytest.approx(loop_weight(deltas, flags, correction), rel=1e-5), b


def test_non_finite_engine_logprobs_get_weight_zero_and_the_loss_stays_finite():
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    rollout = torch.tensor([[-1.1, -math.inf, math.nan, -300.0]])
    mask = torch.ones(1, 4)
    delta, checked = engine_log_ratio(old, rollout, mask)
    assert checked.tolist() == [[True, False, False, True]]
    result = correction_weights(delta, checked, Correction(weight="sequence", weight_cap=None))
    assert torch.isfinite(result.weights).all() and result.weights[0, 1:3].eq(0).all()
    assert result.weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # the clamp before exp
    new = old.clone().requires_grad_(True)
    objective = PolicyObjective(correction=Correction(weight="token", weight_cap=2.0))
    loss, metrics = policy_objective(new, old, torch.ones(1), mask, mask / 4, objective, rollout_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert all(math.isfinite(float(getattr(m, "total", getattr(m, "value", 0.0)))) for m in metrics.values())


def test_empty_mask_gives_zero_weights_and_empty_metrics():
    old, rollout = torch.zeros(2, 3), torch.full((2, 3), math.nan)
    delta, checked = engine_log_ratio(old, rollout, torch.ones(2, 3))
    for c in (Correction(weight="geometric"), Correction(mask="sequence")):
        assert correction_weights(delta, checked, c).weights.eq(0).all()
    metrics = mismatch_metrics(delta, checked)
    assert float(metrics["mismatch/kl_k3"].count) == 0 and float(metrics["mismatch/ratio/max"].value) == -math.inf
    assert mismatch_summary(old, rollout, torch.ones(2, 3)) == {"tokens": 0.0}


def test_weights_are_detached_and_fp32():
    old = torch.full((1, 2), -1.0, dtype=torch.bfloat16, requires_grad=True)
    rollout = torch.tensor([[-1.2, -0.9]], dtype=torch.bfloat16)
    delta, checked = engine_log_ratio(old, rollout, torch.ones(1, 2))
    w, _ = truncated_weights(delta, checked, "token", cap=2.0)
    assert w.dtype == torch.float32 and not w.requires_grad


def test_correction_off_leaves_the_objective_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    new = (torch.randn(6, 5, generator=gen) * 0.2 - 1).requires_grad_(True)
    old, adv = new.detach() + torch.randn(6, 5, generator=gen) * 0.1, torch.randn(6, generator=gen)
    rollout = old + torch.randn(6, 5, generator=gen) * 0.3
    mask = (torch.rand(6, 5, generator=gen) < 0.8).float()
    agg = loss_weights(mask, "seq-mean-token-mean", num_tokens=mask.sum(), num_seqs=6, horizon=5)
    plain, _ = policy_objective(new, old, adv, mask, agg, PolicyObjective())
    (plain_grad,) = torch.autograd.grad(plain, new)
    for objective in (PolicyObjective(), PolicyObjective(correction=Correction())):
        loss, metrics = policy_objective(new, old, adv, mask, agg, objective, rollout_logprobs=rollout)
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.equal(loss, plain) and torch.equal(grad, plain_grad)
        assert "mismatch/kl_k3" in metrics and not any(k.startswith("rollout_correction/") for k in metrics)
    # on, with the engine exactly the trainer: weights of 1 change nothing either
    on = PolicyObjective(correction=Correction(weight="token", mask="token"))
    loss, metrics = policy_objective(new, old, adv, mask, agg, on, rollout_logprobs=old)
    assert torch.equal(loss, plain) and float(metrics["rollout_correction/masked_frac"].total) == 0


def test_a_correction_without_engine_logprobs_is_refused():
    objective = PolicyObjective(correction=Correction(weight="token"))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_objective(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), torch.ones(1, 2),
                         objective)  # fmt: skip


# -- the config's [rollout_correction] table ------------------------------------------------------------------


def test_correction_is_off_by_default_and_round_trips_through_toml(tmp_path):
    import rlkit
    from rlkit.config import config_from_toml

    assert not rlkit.GRPOConfig().rollout_correction.enabled
    path = tmp_path / "run.toml"
    path.write_text(
        'algorithm = "grpo"\npolicy_loss = "sapo"\nsapo_tau_neg = 1.2\n[rollout]\nengine_logprobs = 1.0\n'
        '[rollout_correction]\nweight = "token"\nweight_cap = 3.0\nmask = "geometric"\nmask_low = 0.8\n'
    )
    cfg = config_from_toml(path)
    assert cfg.rollout_correction == rlkit.RolloutCorrectionConfig(weight="token", weight_cap=3.0, mask="geometric",
                                                                   mask_low=0.8)  # fmt: skip
    assert cfg.rollout_correction.enabled and cfg.sapo_tau_neg == 1.2
    assert rlkit.GRPOConfig.from_dict(cfg.to_dict()) == cfg


def test_correction_problems_are_reported_at_once():
    import rlkit

    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.GRPOConfig(
            sapo_tau_pos=0.0,
            clip_eps=1.5,
            rollout=rlkit.RolloutConfig(engine="vllm", engine_logprobs=0.125),
            rollout_correction=rlkit.RolloutCorrectionConfig(
                weight="tokens", weight_cap=-1.0, weight_floor=3.0, mask="seq", mask_low=1.5, bypass=True
            ),
        )
    text = str(err.value)
    for expected in (
        'rollout_correction.weight="tokens": use one of',
        'rollout_correction.mask="seq"',
        "rollout_correction.weight_cap=-1.0: must be >= 1",
        "rollout_correction.weight_floor=3.0",
        "the kept band must contain 1",
        "bypass=True with weight=",
        "rollout.engine_logprobs=0.125",
        "sapo_tau_pos=0.0",
        "clip_eps=1.5: must be in (0, 1)",
    ):
        assert expected in text, expected
    assert len(err.value.problems) == 9
    # CISPO takes clip_eps = 1 (no lower clip: TRL's CISPO); the hf engine returns every row's log-probs anyway
    rlkit.GRPOConfig(policy_loss="cispo", clip_eps=1.0, clip_high=4.0)
    rlkit.GRPOConfig(rollout_correction=rlkit.RolloutCorrectionConfig(weight="token"))


def preset_weights(name: str, *deltas: float) -> list[float]:
    """One sequence's weights under preset ``name`` (every token checked), as the worker builds its Correction."""
    import dataclasses

    from rlkit.config import RolloutCorrectionConfig

    settings = dataclasses.asdict(RolloutCorrectionConfig.preset(name))
    return correction_weights(*delta_of(*deltas), Correction(**settings)).weights[0].tolist()


@pytest.mark.parametrize(
    ("name", "deltas", "expected"),
    [
        ("verl_token_is", (LN(3), 0.0, LN(0.25)), [2, 1, 0.25]),  # MISMATCH.md: TIS C=2
        ("slime_tis", (LN(3), 0.0, LN(0.25)), [2, 1, 0.25]),
        ("openrlhf_tis", (LN(0.25), 0.0, LN(8)), [0.5, 1, 5]),  # TIS [.5, 5]
        ("verl_sequence_is", (LN(2), LN(2), 0.0), [2, 2, 2]),  # seq prod C=2
        ("trl_token_truncate", (LN(4), LN(2.5), 0.0), [3, 2.5, 1]),
        ("trl_sequence_truncate", (LN(2), LN(0.75)), [1.5, 1.5]),
        ("trl_sequence_mask", (LN(2), LN(2)), [0, 0]),  # seq mask C=3: product 4 rejected
        ("trl_sequence_mask", (LN(2), LN(0.75)), [1.5, 1.5]),  # kept at its raw value
        ("trl_token_mask", (LN(2.5), LN(4), 0.0), [2.5, 0, 1]),  # kept weights in (2, 3] stay
        ("icepop", (LN(4), LN(0.4), LN(6), 0.0), [4, 0, 0, 1]),  # kept weights in (2, 5] stay
        ("seq_mask_tis", (LN(4), LN(2)), [4, 2]),  # geometric mean 2.83 inside [0.5, 5]: raw token ratios
        ("seq_mask_tis", (LN(8), LN(8)), [0, 0]),  # geometric mean 8: rejected
        ("verl_bypass", (LN(3), 0.0), [1, 1]),
    ],
)
def test_each_preset_equals_its_peer(name, deltas, expected):
    assert preset_weights(name, *deltas) == pytest.approx(expected)


def test_presets_are_named_and_take_overrides():
    import rlkit
    from rlkit.config import CORRECTION_PRESETS

    for name in CORRECTION_PRESETS:
        assert rlkit.RolloutCorrectionConfig.preset(name).enabled and not rlkit.RolloutCorrectionConfig.preset(
            name).problems(), name  # fmt: skip
    assert rlkit.RolloutCorrectionConfig.preset("trl_sequence_mask", mask_high=2.0).mask_high == 2.0
    with pytest.raises(ValueError, match='preset "tis": use one of'):
        rlkit.RolloutCorrectionConfig.preset("tis")


def test_bypass_allows_skipping_the_old_logprob_forward_with_several_optimizer_steps():
    import rlkit

    steps = dict(recompute_logprobs=False, ppo_epochs=2, mini_batches=2)
    rlkit.GRPOConfig(**steps, rollout_correction=rlkit.RolloutCorrectionConfig.preset("verl_bypass"))
    with pytest.raises(rlkit.ConfigError, match="or rollout_correction.bypass=True"):
        rlkit.GRPOConfig(**steps)


def test_settings_that_cannot_be_meant_are_refused():
    """A cap below 1 shrinks the weight of tokens engine and trainer agree on; CISPO's clip_eps above 1 clips
    nothing clip_eps = 1 does not (a ratio is > 0)."""
    import rlkit

    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.GRPOConfig(policy_loss="cispo", clip_eps=10.0,
                         rollout_correction=rlkit.RolloutCorrectionConfig(weight="token", weight_cap=0.5))  # fmt: skip
    assert "rollout_correction.weight_cap=0.5: must be >= 1" in str(err.value)
    assert 'clip_eps=10.0: must be in (0, 1), e.g. 0.2 (in (0, 1] with policy_loss="cispo"' in str(err.value)
    assert len(err.value.problems) == 2
    rlkit.GRPOConfig(rollout_correction=rlkit.RolloutCorrectionConfig(weight="token", weight_cap=1.0))
