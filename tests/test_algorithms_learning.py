"""The algorithm settings of issue 17 through the whole trainer on 2 gloo workers: they run and they learn."""

import pytest
import torch

import rlkit

ROLLOUT = rlkit.RolloutConfig(max_new_tokens=6)


def assert_learns(history, label: str) -> None:
    first, last = history["reward/mean"].head(5).mean(), history["reward/mean"].tail(5).mean()
    assert last > first + 0.2, f"{label}: mean reward went {first:.3f} -> {last:.3f}"


@pytest.mark.timeout(400)
def test_gspo_raises_the_reward(cluster):
    config = rlkit.GRPOConfig(
        model="tiny", seed=0, prompts_per_step=16, group_size=8, rollout=ROLLOUT, optim=rlkit.OptimConfig(lr=5e-4),
        policy_loss="gspo", clip_eps=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean",
    )  # fmt: skip
    assert_learns(rlkit.Trainer(cluster, config).fit(steps=30, progress=False), "gspo")


@pytest.mark.timeout(400)
def test_dynamic_sampling_raises_the_reward_and_counts_its_refills(cluster):
    config = rlkit.GRPOConfig(
        model="tiny", seed=0, prompts_per_step=8, group_size=4, rollout=ROLLOUT, optim=rlkit.OptimConfig(lr=5e-4),
        dynamic_sampling=True, max_refill_rounds=2,
    )  # fmt: skip
    trainer = rlkit.Trainer(cluster, config)
    history = trainer.fit(steps=30, progress=False)
    assert_learns(history, "dynamic sampling")
    assert history["sampling/rounds"].between(0, 2).all() and history["sampling/rounds"].sum() > 0
    batch = trainer.last_batch
    assert len(batch) == 8 * 4 and batch.group.unique().numel() == 8, "every step trains on prompts_per_step groups"
    informative = [batch.rewards[batch.group == g].unique().numel() > 1 for g in batch.group.unique()]
    assert sum(informative) == 8 - history["sampling/filled"].iloc[-1]


@pytest.mark.timeout(200)
def test_overlong_shaping_and_truncation_masking_reach_the_step(cluster):
    """Every completion of 3 tokens at a budget of 3 is truncated: the overlong term takes its full penalty and,
    with mask_truncated, nothing is left in the loss (zero loss, zero gradient)."""
    config = rlkit.GRPOConfig(
        model="tiny", seed=1, prompts_per_step=2, group_size=4, rollout=rlkit.RolloutConfig(max_new_tokens=3,
        min_new_tokens=3), overlong_buffer=2, overlong_penalty=0.5, mask_truncated=True,
    )  # fmt: skip
    trainer = rlkit.Trainer(cluster, config)
    row = trainer.step()
    batch = trainer.last_batch
    assert set(batch.finish_reason) == {"length"}
    assert torch.equal(batch.reward_terms["overlong"], torch.full((8,), -0.5))
    assert torch.allclose(batch.rewards, batch.reward_terms["addition_reward"] - 0.5)
    assert row["actor/loss"] == 0.0 and row["actor/grad_norm"] == 0.0
