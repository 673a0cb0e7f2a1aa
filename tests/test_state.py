"""State you can trust, on 2 gloo ranks through the public API: re-run cells, Stop, failures and a second trainer
never leave a run half-changed (issue 22, defects 1-5).

Faults are planted on the workers through a policy loss of the test's own (``planted_loss``), steered by
environment variables set on the ranks (``plant``): it records its calls in a folder, and can sleep, raise at a
given call, or make the loss infinite.
"""

import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from test_trainer import full_weights

import rlkit
from rlkit.data.rewards import RewardError
from rlkit.runtime import RemoteError, RolesReplaced
from rlkit.trainer.checkpoints import replace_folder
from rlkit.trainer.safety import NeedsResume

SMALL = dict(
    model="tiny", seed=0, prompts_per_step=4, group_size=4, mini_batches=2, micro_batch_size=4,
    rollout=rlkit.RolloutConfig(max_new_tokens=6), optim=rlkit.OptimConfig(lr=1e-3),
)  # fmt: skip
"""16 samples a step, 8 a rank: two mini-batches of one micro-batch each (two optimizer steps an update)."""


def plant(**env: str) -> None:
    """On a worker: the fault ``planted_loss`` plays (STATE_FAULT, STATE_AT, STATE_DIR), its call count reset."""
    os.environ.update({"STATE_FAULT": "", "STATE_AT": "0", "STATE_CALLS": "0", **env})


def planted_loss(new, old, advantages, mask):
    """The plain policy-gradient surrogate, with the planted fault: "sleep" (1 s a call, after writing
    STATE_DIR/started-<call>), "raise" at call STATE_AT, "inf" (an infinite loss, so non-finite gradients)."""
    calls = int(os.environ.get("STATE_CALLS", "0")) + 1
    os.environ["STATE_CALLS"] = str(calls)
    fault = os.environ.get("STATE_FAULT", "")
    loss = -torch.exp(new - old) * advantages
    if fault == "sleep":
        Path(os.environ["STATE_DIR"], f"started-{calls}").touch()
        time.sleep(1.0)
    if fault == "raise" and calls == int(os.environ["STATE_AT"]):
        raise ValueError(f"planted failure at loss call {calls}")
    if fault == "inf":
        loss = loss * float("inf")
    return loss, torch.zeros_like(loss)


def optimizer_state() -> dict:
    """On a worker: the actor's optimizer steps begun and its schedule's step count."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    actor = local_instance(PolicyWorker).actor
    return {"begun": actor.steps_begun, "scheduled": actor.scheduler.last_epoch}


def role_names() -> list[str]:
    """On a worker: the roles alive on this rank."""
    from rlkit.runtime import Role, context

    return sorted(type(v).__name__ for v in context().state.values() if isinstance(v, Role))


def ready_batch(trainer):
    return trainer.advantages(trainer.score(trainer.rollout()))


def trainer_one_step_in(cluster, folder: Path):
    """A trainer with the planted loss after one step, and the checkpoint it saved under ``folder``."""
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL), policy_loss_fn=planted_loss)
    trainer.step()
    return trainer, trainer.save(folder)


def assert_a_resume_goes_on(cluster, checkpoint: Path) -> None:
    """The fault off, ``Trainer.resume`` from ``checkpoint`` (after one step) takes the next step, and each
    rank's engine holds its actor's weights."""
    cluster.run(plant)
    resumed = rlkit.Trainer.resume(cluster, checkpoint, policy_loss_fn=planted_loss)
    resumed.step()
    assert resumed.steps_done == 2
    assert_engine_holds_the_actor(cluster)


def update_with_stops(trainer, batch, folder: Path, at_calls: list[int]) -> KeyboardInterrupt:
    """``trainer.update(batch)`` with Stop pressed (SIGINT to this process) as the ranks begin each of the loss
    calls ``at_calls`` (1 s each, planted); the KeyboardInterrupt it raised. Python's own SIGINT handler is set
    for the call, whatever disposition pytest inherited."""
    trainer.cluster.run(plant, STATE_FAULT="sleep", STATE_DIR=str(folder))

    def press_stop():
        for call in at_calls:
            while not (folder / f"started-{call}").exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        presser = threading.Thread(target=press_stop)
        presser.start()
        with pytest.raises(KeyboardInterrupt) as stopped:
            trainer.update(batch)
        presser.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    return stopped.value


def assert_engine_holds_the_actor(cluster) -> None:
    actor, engine = cluster.run(full_weights, "actor"), cluster.run(full_weights, "engine")
    for rank in range(2):
        for name, value in actor[rank].items():
            assert torch.equal(engine[rank][name], value), f"rank {rank}'s engine is stale in {name}"


# -- 1. refill ids never collide ------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_refill_retried_after_a_reward_failure_keeps_one_prompt_per_group(cluster):
    calls = []

    def reward(prompts, completions, **fields):
        calls.append(len(completions))
        if len(calls) == 2:  # the first refill's scoring fails once
            raise ValueError("planted reward failure")
        if len(calls) == 4:  # the refill of the retried step: informative groups
            return [float(len(c) % 2) for c in completions]
        return [0.0] * len(completions)  # uninformative: every group asks for a refill

    config = rlkit.GRPOConfig(**SMALL, dynamic_sampling=True, max_refill_rounds=1)
    trainer = rlkit.Trainer(cluster, config, reward_fn=reward)
    with pytest.raises(RewardError, match="planted reward failure"):
        trainer.step()
    row = trainer.step(trainer.last_batch)  # the recovery the error's note advises
    batch = trainer.last_batch
    assert len(batch) == 16, f"the step trained {len(batch)} samples, not 4 prompts x 4"
    for group in batch.group.unique().tolist():
        prompts = {p for p, g in zip(batch.prompts, batch.group.tolist(), strict=True) if g == group}
        assert len(prompts) == 1, f"group {group} mixes the prompts {prompts}"
    assert row["sampling/rounds"] == 1 and trainer.steps_done == 1


# -- 2. an update completes or leaves the trainer refusing until a resume --------------------------


@pytest.mark.timeout(240)
def test_stop_during_an_update_completes_it_first(cluster, tmp_path):
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL), policy_loss_fn=planted_loss)
    batch = ready_batch(trainer)
    before = cluster.run(full_weights, "actor")
    stopped = update_with_stops(trainer, batch, tmp_path, at_calls=[2])  # after one optimizer step
    assert "update completed before the interrupt" in "".join(stopped.__notes__)
    assert trainer.steps_done == 1 and list(trainer.history["step"]) == [1]
    assert cluster.run(optimizer_state) == [{"begun": 2, "scheduled": 2}] * 2, "optimizer and schedule: 2 steps each"
    after = cluster.run(full_weights, "actor")
    assert any(not torch.equal(before[0][n], after[0][n]) for n in after[0]), "the update changed nothing"
    assert_engine_holds_the_actor(cluster)
    cluster.run(plant)
    trainer.step()  # the trainer goes on
    assert trainer.steps_done == 2


@pytest.mark.timeout(240)
def test_a_second_stop_abandons_the_update_and_the_trainer_asks_for_a_resume(cluster, tmp_path):
    trainer, checkpoint = trainer_one_step_in(cluster, tmp_path / "ckpt")
    batch = ready_batch(trainer)
    stopped = update_with_stops(trainer, batch, tmp_path, at_calls=[1, 2])  # the second after one optimizer step
    assert "now needs a resume" in "".join(stopped.__notes__)
    with pytest.raises(NeedsResume, match=f"rlkit.Trainer.resume\\(cluster, '{checkpoint}'\\)"):
        trainer.rollout()
    assert trainer.steps_done == 1
    assert_a_resume_goes_on(cluster, checkpoint)


@pytest.mark.timeout(300)
def test_a_failure_in_the_first_mini_batch_changes_nothing_one_in_the_second_asks_for_a_resume(cluster, tmp_path):
    trainer, checkpoint = trainer_one_step_in(cluster, tmp_path / "ckpt")
    batch = ready_batch(trainer)
    cluster.run(plant, STATE_FAULT="raise", STATE_AT="1")
    with pytest.raises(RemoteError, match="planted failure at loss call 1") as first:
        trainer.update(batch)
    assert "no weights changed" in "".join(first.value.__notes__)
    assert cluster.run(optimizer_state) == [{"begun": 2, "scheduled": 2}] * 2
    cluster.run(plant, STATE_FAULT="raise", STATE_AT="2")
    with pytest.raises(RemoteError, match="planted failure at loss call 2") as second:
        trainer.update(batch)  # the first mini-batch's optimizer step ran, the second's not, the engine not
    assert "now needs a resume" in "".join(second.value.__notes__)
    for phase in (trainer.rollout, trainer.step, lambda: trainer.update(batch), lambda: trainer.save(tmp_path)):
        with pytest.raises(NeedsResume, match=f"rlkit.Trainer.resume\\(cluster, '{checkpoint}'\\)"):
            phase()
    assert trainer.steps_done == 1 and len(trainer.history) == 1
    assert_a_resume_goes_on(cluster, checkpoint)


# -- 3. one trainer owns the roles on a cluster ----------------------------------------------------


@pytest.mark.timeout(300)
def test_a_second_trainer_replaces_the_first_which_is_refused_and_frees_a_critic(cluster, tmp_path):
    ppo = rlkit.Trainer(cluster, rlkit.PPOConfig(**SMALL))
    assert cluster.run(role_names) == [["CriticWorker", "PolicyWorker"]] * 2
    grpo = rlkit.Trainer(cluster, rlkit.GRPOConfig(**{**SMALL, "group_size": 2}))
    assert cluster.run(role_names) == [["PolicyWorker"]] * 2, "the PPO trainer's critic stayed resident"
    for call in (ppo.rollout, ppo.step, lambda: ppo.save(tmp_path), ppo.sharding):
        with pytest.raises(RolesReplaced, match=f"{ppo.name} no longer holds its roles.*{grpo.name} replaced them"):
            call()
    row = grpo.step()
    assert row["actor/lr"] == pytest.approx(1e-3) and len(grpo.last_batch) == 8
    assert not list(tmp_path.iterdir()), "the replaced trainer wrote a checkpoint"


# -- 4. phases run by hand count as a step ----------------------------------------------------------


@pytest.mark.timeout(300)
def test_phases_by_hand_count_the_step_move_the_seeds_and_name_the_checkpoints(cluster, tmp_path, caplog):
    def by_length(prompts, completions, **fields):
        return [len(c) % 3 / 2 for c in completions]

    one_prompt = [{"prompt": "12+34="}] * 8  # so that only the sampling seeds can make two draws differ
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL), prompts=one_prompt, reward_fn=by_length)
    drawn = trainer.rollout()
    assert trainer.rollout().completions != drawn.completions, "a second draw reused the first one's sampling seeds"
    first = trainer.advantages(trainer.score(drawn))
    trainer.update(first)
    assert trainer.steps_done == 1 and list(trainer.history["step"]) == [1]
    assert trainer.history["time/rollout"].iloc[0] > 0, "the hand-run rollout's time is not in its step's row"
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        trainer.update(first)
    assert "this batch already trained step 1" in caplog.text
    again = trainer.rollout()
    names = [trainer.save(tmp_path).name]
    trainer.update(trainer.advantages(trainer.score(again)))
    names.append(trainer.save(tmp_path).name)
    assert names == ["step-000002", "step-000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_a_folder_is_replaced_by_renames_never_half_written(tmp_path, monkeypatch):
    def folder(path: Path, text: str) -> Path:
        path.mkdir()
        for name in ("actor", "trainer.json"):
            (path / name).write_text(text)
        return path

    def contents(path: Path) -> dict[str, str]:
        return {p.name: p.read_text() for p in path.iterdir()}

    final = folder(tmp_path / "step-000001", "old")
    replace_folder(folder(tmp_path / ".step-000001.partial-a", "new"), final)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"] and contents(final)["actor"] == "new"

    def killed_after_one_file(path):  # the process dies while the replaced folder is being removed
        sorted(Path(path).iterdir())[0].unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_after_one_file)
    with pytest.raises(SystemExit):
        replace_folder(folder(tmp_path / ".step-000001.partial-b", "newer"), final)
    assert contents(final) == {"actor": "newer", "trainer.json": "newer"}, "the checkpoint is half-written"


# -- 5. a non-finite gradient norm skips the optimizer step -----------------------------------------


@pytest.mark.timeout(240)
def test_non_finite_gradients_skip_the_optimizer_step_and_are_counted(cluster):
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL), policy_loss_fn=planted_loss)
    before = cluster.run(full_weights, "actor")
    cluster.run(plant, STATE_FAULT="inf")
    row = trainer.step()
    assert row["actor/skipped_steps"] == 2 and not torch.isfinite(torch.tensor(row["actor/grad_norm"]))
    after = cluster.run(full_weights, "actor")
    for name, value in before[0].items():
        assert torch.equal(after[0][name], value) and torch.equal(after[1][name], value), f"{name} moved"
    assert_engine_holds_the_actor(cluster)
    cluster.run(plant)
    row = trainer.step()  # the next rollout samples from finite weights, and the update steps again
    assert row["actor/skipped_steps"] == 0 and cluster.run(optimizer_state)[0]["begun"] == 2


# -- the same guarantees for DPO/KTO ---------------------------------------------------------------


def break_preference_losses() -> None:
    """On a worker: the preference loss raises (before the step's only optimizer step)."""
    from rlkit.workers.preference import PreferenceWorker

    def raises(self, *args, **kwargs):
        raise ValueError("planted failure in the preference loss")

    PreferenceWorker._losses = raises


@pytest.mark.timeout(240)
def test_a_preference_step_that_fails_before_its_optimizer_step_changes_nothing(cluster):
    dpo = rlkit.PreferenceTrainer(cluster, rlkit.DPOConfig(batch_size=2))
    dpo.step()
    position = dpo._examples.state_dict()
    cluster.run(break_preference_losses)  # this cluster's last test: its PreferenceWorker stays broken
    with pytest.raises(RemoteError, match="planted failure") as failed:
        dpo.step()
    assert "no weights changed" in "".join(failed.value.__notes__)
    assert dpo.steps_done == 1 and dpo._examples.state_dict() == position, "the failed step's examples were lost"
    grpo = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL))
    with pytest.raises(RolesReplaced, match=f"{dpo.name} no longer holds its roles.*{grpo.name}"):
        dpo.step()
