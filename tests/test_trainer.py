"""The RL loop on 2 gloo workers: updates are real, ranks agree, reward rises, bad input loses nothing."""

import pytest
import torch

import rlkit
from rlkit.data.rewards import RewardError

TINY = dict(model="tiny", seed=0, prompts_per_step=8, group_size=8, rollout=rlkit.RolloutConfig(max_new_tokens=6))


def full_weights(role: str) -> dict[str, torch.Tensor]:
    """On a worker: the actor's gathered full weights (or the rollout engine's own), by name."""
    from torch.distributed.tensor import DTensor

    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    model = worker.actor.model if role == "actor" else worker.engine.model
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


@pytest.mark.timeout(180)
def test_update_changes_every_rank_and_ranks_agree(cluster):
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**TINY, optim=rlkit.OptimConfig(lr=1e-3)))
    before = cluster.run(full_weights, "actor")
    batch = trainer.advantages(trainer.score(trainer.rollout()))
    assert batch.advantages.abs().sum() > 0, "no reward signal in this batch; pick another seed"
    trainer.update(batch)
    after = cluster.run(full_weights, "actor")
    engines = cluster.run(full_weights, "engine")
    for name in before[0]:
        for rank in range(2):
            assert not torch.equal(before[rank][name], after[rank][name]), f"{name} unchanged on rank {rank}"
        assert torch.equal(after[0][name], after[1][name]), f"ranks disagree on {name}"
        assert torch.equal(engines[0][name], after[0][name]), f"weight sync missed {name}"


@pytest.mark.timeout(300)
def test_short_fit_raises_mean_reward(cluster):
    config = rlkit.GRPOConfig(**{**TINY, "prompts_per_step": 16}, kl_coef=0.01, optim=rlkit.OptimConfig(lr=5e-4))
    history = rlkit.Trainer(cluster, config).fit(steps=30, progress=False)
    first, last = history["reward/mean"].head(5).mean(), history["reward/mean"].tail(5).mean()
    assert last > first + 0.2, f"mean reward went {first:.3f} -> {last:.3f}"
    assert (history["rollout/logprob_gap/max"] < 1e-3).all(), "engine and trainer log-probs disagree"


@pytest.mark.timeout(120)
def test_reward_error_names_function_and_sample_and_keeps_batch(cluster):
    def half_nan(prompts, completions, **fields):
        return [float("nan") if i == 3 else 1.0 for i in range(len(completions))]

    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**TINY), reward_fn=half_nan)
    batch = trainer.rollout()
    with pytest.raises(RewardError, match=r"'half_nan' returned nan for sample 3"):
        trainer.score(batch)
    assert batch.rewards is None and len(batch) == 64


@pytest.mark.timeout(120)
def test_too_long_prompt_is_rejected_before_any_model_loads_or_dropped_on_request(cluster):
    prompts = [{"prompt": p, "answer": "2"} for p in ["1+1=", "2+2=" * 40]]
    reward = {"one": lambda prompts, completions, answer: [1.0] * len(prompts)}
    config = rlkit.GRPOConfig(**{**TINY, "prompts_per_step": 2})
    with pytest.raises(rlkit.ConfigError, match=r"1 of 2 prompts are longer than data.max_prompt_tokens=64"):
        rlkit.Trainer(cluster, config, prompts=prompts, reward_fn=reward)
    dropping = rlkit.GRPOConfig(**{**TINY, "prompts_per_step": 2}, data=rlkit.config.DataConfig(long_prompts="drop"))
    batch = rlkit.Trainer(cluster, dropping, prompts=prompts, reward_fn=reward).rollout()
    assert set(batch.prompts) == {"1+1="}, "the long prompt was served"


@pytest.mark.timeout(240)
def test_update_scores_the_rollout_when_the_logprob_pass_is_skipped(cluster):
    """recompute_logprobs=False: same rollout, log-probs, loss and gradient as with the separate pass."""
    results = {}
    for recompute in (True, False):
        config = rlkit.GRPOConfig(**TINY, recompute_logprobs=recompute, optim=rlkit.OptimConfig(lr=1e-3))
        trainer = rlkit.Trainer(cluster, config)
        batch = trainer.advantages(trainer.score(trainer.rollout()))
        assert (batch.old_logprobs is None) == (not recompute)
        stats = trainer.update(batch)
        results[recompute] = (batch, stats)
    (full, full_stats), (skip, skip_stats) = results[True], results[False]
    assert torch.equal(full.input_ids, skip.input_ids), "the two trainers did not sample the same rollout"
    mask = skip.response_mask.bool()
    torch.testing.assert_close(skip.old_logprobs[mask], full.old_logprobs[mask], atol=1e-5, rtol=0)
    assert skip_stats["actor/loss"] == pytest.approx(full_stats["actor/loss"], abs=1e-6)
    assert skip_stats["actor/grad_norm"] == pytest.approx(full_stats["actor/grad_norm"], rel=1e-4)
    assert skip_stats["actor/clipfrac"] == 0.0 and skip_stats["actor/approx_kl"] == 0.0


@pytest.mark.timeout(240)
def test_steps_past_the_schedule_hold_its_last_lr_and_warn(cluster, caplog):
    """The cosine schedule spans config.steps=3 optimizer steps; fit(5) runs two more at its floor, with a warning."""
    import logging

    optim = rlkit.OptimConfig(lr=1e-3, schedule="cosine", min_lr_ratio=0.1)
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**TINY, steps=3, optim=optim))
    with caplog.at_level(logging.WARNING, logger="rlkit.trainer"):
        history = trainer.fit(5, progress=False)
    # actor/lr is the rate of the next optimizer step: factors 0.55 (halfway), then the floor 0.1, held
    assert history["actor/lr"].tolist() == pytest.approx([5.5e-4, 1e-4, 1e-4, 1e-4, 1e-4])
    warnings = [r.getMessage() for r in caplog.records if "past config.steps=3" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 4 ")
