"""Faults injected while the trainer runs: each surfaces as itself, names the rank, and loses nothing.

These tests launch clusters of their own (a fault kills one): launching shuts every earlier cluster of the
process down, so they live apart from the tests that share a module's cluster.
"""

import pytest
from test_ppo import ROLLOUT, build_reward_model

import rlkit
from rlkit.data.rewards import RewardError
from rlkit.runtime import WorkerDied


def break_reward_model_scoring(how: str) -> None:
    """On a worker: the fault to inject. RewardModelWorker.score now raises on every rank (as a bad input
    would: one rank alone raising would leave the others waiting in FSDP's collectives), or exits rank 1."""
    import os

    from rlkit.runtime import context
    from rlkit.workers import RewardModelWorker

    def exits(self, texts):
        os._exit(3)

    def raises(self, texts):
        raise ValueError("planted failure in the reward model")

    if how == "raise":
        RewardModelWorker.score = raises
    elif context().rank == 1:
        RewardModelWorker.score = exits


@pytest.mark.timeout(300)
def test_reward_model_failures_a_rank_error_is_a_reward_error_a_dead_rank_is_worker_died(tmp_path):
    build_reward_model(tmp_path)
    config = rlkit.GRPOConfig(
        model="tiny", seed=0, prompts_per_step=2, group_size=2, rollout=ROLLOUT,
        reward_model=rlkit.RewardModelConfig(path=str(tmp_path)),
    )  # fmt: skip
    with rlkit.launch(world_size=2) as cluster:  # its own cluster: the second fault kills it
        trainer = rlkit.Trainer(cluster, config)
        batch = trainer.rollout()
        cluster.run(break_reward_model_scoring, "raise")
        with pytest.raises(RewardError, match="planted failure") as raised:
            trainer.step(batch)
        assert "Nothing is lost" in str(raised.value)
        assert cluster.run(lambda: 1) == [1, 1], "a reward model that raised must leave the cluster usable"
        cluster.run(break_reward_model_scoring, "exit")
        with pytest.raises(WorkerDied) as died:
            trainer.step(batch)
        assert died.value.rank == 1 and "Nothing is lost" not in str(died.value)
