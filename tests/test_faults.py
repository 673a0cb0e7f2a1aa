"""Faults injected while the trainer runs: each surfaces as itself, names the rank, and loses nothing.

These tests launch clusters of their own (a fault kills one): launching shuts every earlier cluster of the
process down, so they live apart from the tests that share a module's cluster.
"""

import pytest
import torch
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
        assert "Nothing is lost" in "".join(raised.value.__notes__)  # a note: the notebook's advice, not the CLI's
        assert cluster.run(lambda: 1) == [1, 1], "a reward model that raised must leave the cluster usable"
        cluster.run(break_reward_model_scoring, "exit")
        with pytest.raises(WorkerDied) as died:
            trainer.step(batch)
        assert died.value.rank == 1 and "Nothing is lost" not in str(died.value)


# -- a rank killed in every phase of a step: named with the phase, the checkpoint stays, the run resumes exactly --

CONFIG = dict(
    model="tiny", seed=5, prompts_per_step=4, group_size=4, kl_coef=0.01, rollout=ROLLOUT,
    optim=rlkit.OptimConfig(lr=5e-4), checkpoint=rlkit.CheckpointConfig(keep_last=1, export_hf=False),
)  # fmt: skip
PHASES = {
    "rollout": "PolicyWorker.rollout",
    "reference": "PolicyWorker.rollout",  # the reference scores inside the rollout call
    "update": "PolicyWorker.update",
    "sync": "PolicyWorker.update",  # the weight sync ends the update call
    "checkpoint": "ActorRole.save",  # PolicyWorker's save is its base class's
}
"""Where each fault strikes, and the call (the phase) the error must name."""


def kill_rank_1_in(phase: str) -> None:
    """On a worker: rank 1 exits the next time it reaches ``phase`` (the fault to inject)."""
    import os

    from rlkit.runtime import context, local_instance
    from rlkit.workers import PolicyWorker
    from rlkit.workers.actor import ActorRole

    def exit_now(*args, **kwargs):
        os._exit(3)

    scored = PolicyWorker._scored_logprobs

    def exit_when_the_reference_scores(self, model, input_ids, attention_mask):
        if model is self.reference:
            os._exit(3)
        return scored(self, model, input_ids, attention_mask)

    if context().rank != 1:
        return
    if phase == "rollout":  # inside generation
        type(local_instance(PolicyWorker).engine).generate = exit_now
    elif phase == "reference":
        PolicyWorker._scored_logprobs = exit_when_the_reference_scores
    elif phase == "update":  # at the first micro-batch's forward
        PolicyWorker._new_logprobs = exit_now
    elif phase == "sync":
        PolicyWorker.sync_engine = exit_now
    else:  # while the checkpoint is written
        ActorRole.save = exit_now


def weights_and_prompts(trainer) -> tuple[dict, list[str]]:
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    weights = trainer.cluster.run(lambda: dict(iter_full_params(local_instance(PolicyWorker).actor.model)))[0]
    return weights, trainer.last_batch.prompts


@pytest.fixture(scope="module")
def straight_run():
    """Step 3 of a run that was never interrupted: its prompts and the weights after it."""
    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**CONFIG))
        trainer.fit(3, progress=False)
        return weights_and_prompts(trainer)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_rank_killed_in_any_phase_is_named_and_a_resume_continues_exactly(tmp_path, straight_run, phase):
    from rlkit.trainer import checkpoints

    folder = tmp_path / "ckpt"
    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**CONFIG))
        trainer.fit(2, progress=False)
        trainer.save(folder)
        cluster.run(kill_rank_1_in, phase)
        with pytest.raises(WorkerDied) as died:
            trainer.step()
            trainer.save(folder)  # the checkpoint phase: step 3 ran, its checkpoint is being written
        assert died.value.rank == 1 and PHASES[phase] in str(died.value), str(died.value)
    assert [p.name for p in checkpoints.complete(folder)] == ["step-000002"], "keep_last counted a partial one"
    with rlkit.launch(world_size=2) as cluster:
        resumed = rlkit.Trainer.resume(cluster, folder)
        resumed.step()
        weights, prompts = weights_and_prompts(resumed)
    expected_weights, expected_prompts = straight_run
    assert prompts == expected_prompts, "the resumed run drew other prompts"
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), f"{name} differs from the uninterrupted run"


def allocate_too_much_in_the_update() -> None:
    """On a worker: the update's forward asks the host for 2^45 floats (an allocation that must fail)."""
    from rlkit.workers import PolicyWorker

    def greedy(self, micro):
        return torch.empty(2**45), None

    PolicyWorker._new_logprobs = greedy


@pytest.mark.timeout(300)
def test_out_of_memory_in_the_update_names_rank_phase_and_what_holds_memory():
    from rlkit.runtime import WorkerOutOfMemory

    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**CONFIG))
        batch = trainer.advantages(trainer.score(trainer.rollout()))
        cluster.run(allocate_too_much_in_the_update)
        with pytest.raises(WorkerOutOfMemory) as err:
            trainer.update(batch)
        text = str(err.value)
        assert "PolicyWorker.update" in text and "ran out of memory" in text and "rank 0" in text
        for held in ("parameters MiB", "gradients MiB", "optimizer state MiB", "rollout engine MiB"):
            assert held in text, f"{held!r} missing from the report:\n{text}"
        assert cluster.run(lambda: 1) == [1, 1], "an out-of-memory error leaves the cluster usable"
