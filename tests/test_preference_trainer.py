"""rlkit.PreferenceTrainer on 2 gloo workers: bad data stops it before anything loads, DPO and KTO learn the
shipped addition preferences, the diagnostics read its role, and a resumed run equals one that never stopped."""

import math

import pytest
import torch

import rlkit

LEARNING = dict(model="tiny", batch_size=16, micro_batch_size=8, beta=0.5, optim=rlkit.OptimConfig(lr=2e-4))
"""The settings of notebooks/07_dpo.ipynb: the accuracy on the shipped pairs goes from 0 to about 0.85 in 40 steps."""


def has_preference_worker() -> bool:
    """On a worker: whether a PreferenceWorker was ever built on this rank."""
    from rlkit.runtime import context

    return any(key.endswith("PreferenceWorker") for key in context().state)


@pytest.mark.timeout(120)
def test_bad_data_is_reported_at_once_before_any_model_loads(cluster):
    pairs = [
        {"prompt": "1+1=", "chosen": "2", "rejected": ""},  # an empty completion
        {"prompt": "", "chosen": "4", "rejected": "5"},  # an empty prompt
        {"prompt": "12345+67890=", "chosen": "80235", "rejected": "80234"},  # 12 and 6 tokens: over both limits
        {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "user", "content": "5"}]},  # a completion that is not the assistant's turn
    ]  # fmt: skip
    config = rlkit.DPOConfig(data={"max_prompt_tokens": 8, "max_completion_tokens": 4}, batch_size=2)
    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.PreferenceTrainer(cluster, config, pairs=pairs)
    text = str(err.value)  # the lengths of the one row whose values are fine are checked too
    assert len(err.value.problems) == 4, text
    assert 'column "rejected": 2 row(s) are not a non-empty string' in text and "(row 0: '', row 3:" in text
    assert 'column "prompt": 1 row(s)' in text and "(row 1: '')" in text
    assert "1 of 1 prompts are longer than data.max_prompt_tokens=8 (the longest has 12 tokens" in text
    assert "raise data.max_prompt_tokens to 12" in text
    assert "2 of 2 completions are longer than data.max_completion_tokens=4" in text
    assert "row 2 chosen (6 tokens)" in text
    with pytest.raises(rlkit.ConfigError, match=r"lacks the column\(s\) \['label'\]"):
        rlkit.PreferenceTrainer(cluster, rlkit.KTOConfig(batch_size=4), pairs=[{"prompt": "1+1=", "completion": "2"}])
    with pytest.raises(rlkit.ConfigError, match="batch_size=3 does not divide across 2 ranks"):
        rlkit.PreferenceTrainer(cluster, rlkit.DPOConfig(batch_size=3))
    assert cluster.run(has_preference_worker) == [False, False]


@pytest.mark.timeout(240)
def test_dpo_raises_preference_accuracy_and_the_diagnostics_read_it(cluster):
    trainer = rlkit.PreferenceTrainer(cluster, rlkit.DPOConfig(**LEARNING, steps=40))
    history = trainer.fit(progress=False)
    first = history.iloc[0]  # the policy is the reference: every implicit reward is 0, the loss -log sigmoid(0)
    assert (first["rewards/accuracy"], first["rewards/margins"]) == (0.0, 0.0)
    assert first["actor/loss"] == pytest.approx(math.log(2), rel=1e-6)
    early, late = history["rewards/accuracy"].head(5).mean(), history["rewards/accuracy"].tail(10).mean()
    assert early <= 0.55 and late >= 0.75, f"accuracy {early:.3f} -> {late:.3f}"
    assert history["rewards/margins"].tail(10).mean() > 0.5
    assert (history["actor/grad_norm_rank_spread"] == 0).all()
    examples = trainer.examples()  # the last step's pairs, their rewards as in the history's last row
    assert len(examples) == 16 and examples["reward/chosen"].mean() == pytest.approx(history["rewards/chosen"].iloc[-1])
    margins = examples["reward/chosen"] - examples["reward/rejected"]
    assert (margins > 0).mean() == pytest.approx(history["rewards/accuracy"].iloc[-1])
    norms = trainer.grad_norms()  # the last step's: each rank's report agrees with the true global norm
    assert norms.ok and norms.global_norm == pytest.approx(history["actor/grad_norm"].iloc[-1], rel=1e-5)
    sharding = trainer.sharding()
    assert set(sharding.params["rank"]) == {0, 1} and not sharding.unwrapped
    assert "reference" in set(sharding.totals["role"])
    assert "error" not in set(trainer.lint().to_pandas()["severity"])
    assert {"reference", "forward_backward", "optimizer_step"} <= set(trainer.memory()["phase"])


@pytest.mark.timeout(240)
def test_kto_learns_and_its_trackers_get_every_row(cluster, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held_out = [{"prompt": f"{a}+{a}=", "completion": str(2 * a + (a % 2)), "label": a % 2 == 0} for a in range(6)]
    config = rlkit.KTOConfig(**LEARNING, steps=30, trackers=["tensorboard"], output_dir=str(tmp_path),
                             validation={"every": 15})  # fmt: skip
    trainer = rlkit.PreferenceTrainer(cluster, config, val_pairs=held_out)
    history = trainer.fit(progress=False)
    trainer.close()
    scored = history.dropna(subset=["val/loss"])  # the held-out examples, scored at steps 15 and 30
    assert scored["step"].tolist() == [15, 30] and (scored["val/kto/z_ref"] >= 0).all()
    assert scored[["val/rewards/chosen", "val/rewards/rejected", "val/rewards/accuracy"]].notna().all().all()
    first = history.iloc[0]  # r = z_ref = 0: each loss is 1 - sigmoid(0)
    assert (first["actor/loss"], first["kto/z_ref"], first["rewards/accuracy"]) == (0.5, 0.0, 0.0)
    early, late = history["rewards/accuracy"].head(5).mean(), history["rewards/accuracy"].tail(10).mean()
    assert early <= 0.55 and late >= 0.65, f"accuracy {early:.3f} -> {late:.3f}"
    assert history["rewards/rejected"].tail(10).mean() < -0.5 < history["rewards/margins"].tail(10).mean()
    assert set(trainer.examples()["label"]) == {True, False}
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("rewards/accuracy")] == list(range(1, 31))


@pytest.mark.timeout(240)
def test_dpo_scores_held_out_pairs_before_and_during_training_as_an_unsharded_model_does(cluster):
    """7 held-out pairs on 2 ranks (the last rank's share padded with a repeat, left out of the figures): the
    eval loss and rewards match the same DPO math on the full weights in one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.algos import dpo_loss, preference_metrics
    from rlkit.models.tiny import TINY_MODEL_DIR

    held_out = [{"prompt": f"{a}+{a + 3}=", "chosen": str(2 * a + 3), "rejected": str(2 * a + 4)} for a in range(7)]
    config = rlkit.DPOConfig(**LEARNING, steps=4, validation={"every": 2, "before_training": True})
    trainer = rlkit.PreferenceTrainer(cluster, config, val_pairs=held_out)
    history = trainer.fit(progress=False)
    assert history["step"].tolist() == [0, 1, 2, 3, 4]
    assert history["val/loss"].notna().tolist() == [True, False, True, False, True]
    before = history.iloc[0]  # the policy is the reference: every implicit reward is 0
    assert before["val/loss"] == pytest.approx(math.log(2), rel=1e-6) and before["val/rewards/accuracy"] == 0.0

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    policy, reference = (AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR) for _ in range(2))
    policy.load_state_dict(cluster.run(actor_weights)[0], strict=False)  # lm_head is tied to the embedding
    policy.tie_weights()

    def summed(model, prompt, completion):
        ids = tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = ids + [tokenizer.eos_token_id]
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        start = len(tokenizer(prompt)["input_ids"])
        return logps[torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])].sum()

    logps = {
        f"{role}/{column}": torch.stack([summed(model, r["prompt"], r[column]) for r in held_out])
        for role, model in (("policy", policy), ("reference", reference))
        for column in ("chosen", "rejected")
    }
    losses, chosen, rejected = dpo_loss(logps["policy/chosen"], logps["policy/rejected"], logps["reference/chosen"],
                                        logps["reference/rejected"], beta=config.beta)  # fmt: skip
    expected = {"val/loss": losses.mean().item(),
                **{f"val/{k}": v for k, v in preference_metrics(chosen, rejected).items()}}  # fmt: skip
    last = history.iloc[-1]
    for name, value in expected.items():
        assert last[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def actor_weights() -> dict[str, torch.Tensor]:
    """On a worker: the policy's full weights (a collective)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers import PreferenceWorker

    return dict(iter_full_params(local_instance(PreferenceWorker).actor.model))


@pytest.mark.timeout(240)
def test_resume_is_exact_across_an_epoch_boundary(cluster, tmp_path):
    """24 pairs in batches of 16: the second and third steps straddle an epoch, whose new order must survive."""
    pairs = [{"prompt": f"{a}+{a + 1}=", "chosen": str(2 * a + 1), "rejected": str(2 * a)} for a in range(24)]
    config = rlkit.DPOConfig(**{**LEARNING, "optim": rlkit.OptimConfig(lr=5e-4, warmup_steps=2)}, steps=4)
    straight = rlkit.PreferenceTrainer(cluster, config, pairs=pairs)
    straight.fit(progress=False)
    expected, expected_examples = cluster.run(actor_weights)[0], straight.examples()

    first = rlkit.PreferenceTrainer(cluster, config, pairs=pairs)
    first.fit(2, progress=False)
    saved = first.save(tmp_path / "ckpt")
    assert saved.name == "step-000002"
    with pytest.raises(ValueError, match="saved prompt position is for 24 prompts but this source has 128"):
        rlkit.PreferenceTrainer.resume(cluster, tmp_path / "ckpt")  # the pairs were not passed again
    resumed = rlkit.PreferenceTrainer.resume(cluster, tmp_path / "ckpt", pairs=pairs)
    assert resumed.steps_done == 2
    resumed.fit(progress=False)  # up to config.steps: the 2 steps left
    assert resumed.steps_done == 4
    for name, value in cluster.run(actor_weights)[0].items():
        assert torch.equal(value, expected[name]), f"{name} differs after resume"
    columns = ["step", "rewards/accuracy", "rewards/margins", "actor/loss", "actor/grad_norm", "actor/lr"]
    assert resumed.history[columns].equals(straight.history[columns])
    assert resumed.examples()["prompt"].tolist() == expected_examples["prompt"].tolist()
