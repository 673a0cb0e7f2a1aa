"""The algorithm settings of issue 17 (RL configs) and the preference configs: every problem at once, named."""

import inspect

import pytest

from rlkit import algos
from rlkit.config import (
    ConfigError,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    OptimConfig,
    PPOConfig,
    RolloutConfig,
    config_from_toml,
)


def test_new_rl_defaults_are_valid_and_match_the_functions():
    for cfg in (GRPOConfig(), PPOConfig()):
        assert (cfg.policy_loss, cfg.log_ratio_clamp, cfg.kl_clamp, cfg.kl_estimator) == ("ppo_clip", 20.0, 10.0, "k3")
        assert (cfg.overlong_buffer, cfg.mask_truncated, cfg.dynamic_sampling) == (0, False, False)
    # one default for the KL estimator and its clamps, wherever the KL goes
    for fn in (algos.kl_estimate, algos.kl_reward_penalty):
        params = inspect.signature(fn).parameters
        assert params["estimator"].default == PPOConfig().kl_estimator == GRPOConfig().kl_estimator
        assert params["clamp"].default == GRPOConfig().kl_clamp
        assert params["log_ratio_clamp"].default == GRPOConfig().log_ratio_clamp
    assert algos.PolicyLossSettings().log_ratio_clamp == GRPOConfig().log_ratio_clamp
    for fn in (algos.ppo_clip_policy_loss, algos.gspo_policy_loss, algos.cispo_policy_loss, algos.sapo_policy_loss):
        assert inspect.signature(fn).parameters["log_ratio_clamp"].default == GRPOConfig().log_ratio_clamp
    settings, sapo = algos.PolicyLossSettings(), inspect.signature(algos.sapo_policy_loss).parameters
    assert (settings.sapo_tau_pos, settings.sapo_tau_neg) == (GRPOConfig().sapo_tau_pos, GRPOConfig().sapo_tau_neg)
    assert (sapo["tau_pos"].default, sapo["tau_neg"].default) == (1.0, 1.05)


def test_new_rl_settings_are_accepted():
    cfg = GRPOConfig(
        policy_loss="gspo",
        clip_eps=3e-4,
        clip_high=4e-4,
        loss_agg="seq-mean-token-sum-norm",
        advantage="reinforce++-baseline",
        kl_clamp=None,
        overlong_buffer=4,
        overlong_penalty=0.5,
        mask_truncated=True,
        dynamic_sampling=True,
        max_refill_rounds=2,
        rollout=RolloutConfig(max_new_tokens=8),
    )
    assert GRPOConfig.from_dict(cfg.to_dict()) == cfg
    for mode in algos.LOSS_AGG_MODES:
        assert GRPOConfig(loss_agg=mode).loss_agg == mode


def test_new_rl_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(
            policy_loss="cipso",
            log_ratio_clamp=100.0,
            kl_clamp=0.0,
            loss_agg="seq-sum",
            overlong_buffer=20,
            overlong_penalty=-1.0,
            dynamic_sampling=True,
            max_refill_rounds=0,
            rollout=RolloutConfig(max_new_tokens=16),
        )
    text = str(err.value)
    for name in (
        "policy_loss=\"cipso\": use one of ['ppo_clip', 'gspo', 'cispo', 'sapo']",
        "log_ratio_clamp=100.0: must be in (0, 80]",
        "kl_clamp=0.0: must be > 0",
        'loss_agg="seq-sum"',
        "overlong_buffer=20: must be in [0, rollout.max_new_tokens=16]",
        "overlong_penalty=-1.0",
        "max_refill_rounds=0: must be >= 1",
    ):
        assert name in text
    assert len(err.value.problems) == 7


def test_group_settings_need_groups():
    with pytest.raises(ConfigError, match='group_size=1: must be >= 2 with advantage="reinforce\\+\\+-baseline"'):
        GRPOConfig(advantage="reinforce++-baseline", group_size=1)
    with pytest.raises(ConfigError, match="dynamic_sampling=True with group_size=1: groups of one sample"):
        PPOConfig(dynamic_sampling=True)
    assert PPOConfig(max_refill_rounds=0).max_refill_rounds == 0  # only checked with dynamic_sampling


# -- preference configs ------------------------------------------------------------------------------------------


def test_preference_defaults_and_round_trip(tmp_path):
    dpo, kto = DPOConfig(), KTOConfig()
    assert (dpo.loss, dpo.beta, dpo.label_smoothing, dpo.reference_free) == ("sigmoid", 0.1, 0.0, False)
    assert dpo.optim.lr == kto.optim.lr == 1e-6
    assert (kto.desirable_weight, kto.undesirable_weight) == (1.0, 1.0)
    for cfg in (DPOConfig(loss="ipo", beta=0.5), KTOConfig(undesirable_weight=1.3), DPOConfig(reference_free=True)):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "dpo.toml"
    path.write_text('algorithm = "dpo"\nbeta = 0.2\nlabel_smoothing = 0.1\n[optim]\nlr = 5e-7\n')
    cfg = config_from_toml(path)
    assert (cfg.beta, cfg.label_smoothing, cfg.optim) == (0.2, 0.1, OptimConfig(lr=5e-7))
    assert DPOConfig(optim={"lr": 2e-6}).optim == OptimConfig(lr=2e-6)
    with pytest.raises(ConfigError, match='algorithm="kto" given to DPOConfig'):
        DPOConfig.from_dict(kto.to_dict())
    with pytest.raises(ConfigError, match=r"unknown setting betta: did you mean beta\?"):
        DPOConfig.from_dict({"betta": 0.1})


def test_dpo_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        DPOConfig(beta=0.0, loss="hinge", label_smoothing=0.7, batch_size=0, steps=0, optim=OptimConfig(lr=0.0))
    text = str(err.value)
    for name in ("beta=0.0", 'loss="hinge"', "label_smoothing=0.7", "batch_size=0", "steps=0", "optim.lr=0.0"):
        assert name in text
    assert len(err.value.problems) == 6
    with pytest.raises(ConfigError, match='label_smoothing=0.1 with loss="ipo"'):
        DPOConfig(loss="ipo", label_smoothing=0.1)


def test_kto_problems_and_cluster_checks():
    with pytest.raises(ConfigError) as err:
        KTOConfig(desirable_weight=0.0, undesirable_weight=-1.0, model="/no/such/dir")
    assert len(err.value.problems) == 3 and "/no/such/dir" in str(err.value)
    KTOConfig(batch_size=4).check_cluster(2)
    with pytest.raises(ConfigError, match="need >= 2 examples per rank; use batch_size >= 4"):
        KTOConfig(batch_size=2).check_cluster(2)
    with pytest.raises(ConfigError, match="batch_size=5 does not divide across 2 ranks"):
        DPOConfig(batch_size=5).check_cluster(2)
