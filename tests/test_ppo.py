"""PPO with a critic, reward models, custom estimators and reward errors, through rlkit.Trainer on 2 gloo workers."""

import shutil

import pytest
import torch

import rlkit
from rlkit.algos import kl_estimate, outcome_token_rewards, rloo_advantages
from rlkit.data.rewards import RewardError
from rlkit.data.tasks import addition_reward
from rlkit.models import resolve_model_dir

ROLLOUT = rlkit.RolloutConfig(max_new_tokens=6)
METRICS = [
    "actor/clipfrac",
    "actor/approx_kl",
    "actor/entropy",
    "critic/explained_variance",
    "critic/value_clipfrac",
    "critic/loss",
    "reward/mean",
    "reward/std",
    "response/length/mean",
    "response/length/max",
    "actor/grad_norm",
    "actor/lr",
    "critic/lr",
    "time/rollout",
    "time/score",
    "time/advantages",
    "time/update",
    "perf/tokens_per_s",
]


def critic_weights() -> dict[str, torch.Tensor]:
    """On a worker: the critic's full weights (a collective)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers import CriticWorker

    return dict(iter_full_params(local_instance(CriticWorker).critic.model))


@pytest.mark.timeout(400)
def test_ppo_with_critic_raises_mean_reward(cluster):
    config = rlkit.PPOConfig(
        model="tiny",
        seed=0,
        prompts_per_step=64,
        ppo_epochs=2,
        mini_batches=2,
        rollout=ROLLOUT,
        optim=rlkit.OptimConfig(lr=5e-4),
        critic=rlkit.CriticConfig(optim=rlkit.OptimConfig(lr=1e-3)),
    )
    history = rlkit.Trainer(cluster, config).fit(steps=15, progress=False)
    first, last = history["reward/mean"].head(3).mean(), history["reward/mean"].tail(3).mean()
    assert last > first + 0.15, f"mean reward went {first:.3f} -> {last:.3f}"
    missing = [m for m in METRICS if m not in history]
    assert not missing, f"metrics missing from history: {missing}"
    assert history[METRICS].notna().all().all()
    assert (history["actor/clipfrac"] > 0).any() and (history["actor/approx_kl"] > 0).any()
    assert (history["rollout/logprob_gap/max"] < 1e-3).all(), "engine and trainer log-probs disagree"


@pytest.mark.timeout(300)
def test_ppo_phases_and_critic_resume(cluster, tmp_path):
    config = rlkit.PPOConfig(
        model="tiny", seed=1, prompts_per_step=8, kl_coef=0.05, rollout=ROLLOUT, optim=rlkit.OptimConfig(lr=1e-3)
    )
    trainer = rlkit.Trainer(cluster, config)
    trainer.step()  # the policy moves away from the reference
    batch = trainer.rollout()
    mask = batch.response_mask
    assert batch.values.shape == mask.shape and (batch.values[mask == 0] == 0).all()
    batch = trainer.advantages(trainer.score(batch))
    # returns - values are GAE's raw advantages; the advantages are the same, whitened over the batch
    raw = (batch.returns - batch.values) * mask
    valid = mask > 0
    whitened = (raw[valid] - raw[valid].mean()) / raw[valid].std()
    torch.testing.assert_close(batch.advantages[valid], whitened, rtol=1e-4, atol=1e-5)
    # kl_mode="reward": every token's reward carries -kl_coef * KL(policy || reference), the last one the outcome too
    from rlkit.trainer.advantages import advantage_inputs

    penalty = advantage_inputs(batch, config).token_rewards - outcome_token_rewards(batch.rewards, mask)
    torch.testing.assert_close(penalty, -0.05 * kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k3") * mask)
    assert penalty.abs().sum() > 0
    before = cluster.run(critic_weights)[0]
    stats = trainer.update(batch)
    assert {"critic/loss", "critic/value_clipfrac", "actor/entropy"} <= stats.keys()
    after = cluster.run(critic_weights)
    assert all(not torch.equal(before[k], after[0][k]) for k in before), "the critic did not change"
    assert all(torch.equal(after[0][k], after[1][k]) for k in before), "ranks disagree on the critic"
    saved = trainer.save(tmp_path / "ckpt")
    rlkit.Trainer(cluster, config)  # fresh models on the workers...
    assert not torch.equal(cluster.run(critic_weights)[0]["score.weight"], after[0]["score.weight"])
    resumed = rlkit.Trainer.resume(cluster, saved)  # ...then the checkpoint's
    assert isinstance(resumed.config, rlkit.PPOConfig)
    restored = cluster.run(critic_weights)[0]
    assert all(torch.equal(restored[k], after[0][k]) for k in before), "the critic was not restored"


def build_reward_model(directory) -> None:
    """A random one-label sequence classifier with the tiny model's shape and tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tiny = resolve_model_dir("tiny")
    config = AutoConfig.from_pretrained(tiny, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, directory / name)


def reference_scores(directory, texts: list[str]) -> torch.Tensor:
    """The same model in this process, one text at a time (no padding at all)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        return torch.cat([model(**tokenizer(t, return_tensors="pt")).logits[:, 0] for t in texts])


def record_forward_tokens(on: bool) -> dict[str, list[int]]:
    """On a worker: from now on (on=True) record the real tokens of each scoring forward of the actor and reference
    (log-probs), the critic (values) and the reward model; returns what was recorded, and stops (on=False)."""
    import rlkit.workers.critic as critic
    import rlkit.workers.policy as policy
    import rlkit.workers.reward_model as reward_model
    from rlkit.runtime import context

    names = {"logprobs": (policy, "response_logprobs"), "values": (critic, "response_values"),
             "reward_model": (reward_model, "sequence_scores")}  # fmt: skip
    state = context().state
    if not on:
        for module, attribute in names.values():
            setattr(module, attribute, state["originals"][attribute])
        return state.pop("tokens")
    state["tokens"], state["originals"] = {name: [] for name in names}, {}

    def recording(name, forward):
        def wrapper(model, input_ids, attention_mask, *args, **kwargs):
            state["tokens"][name].append(int(attention_mask.sum()))
            return forward(model, input_ids, attention_mask, *args, **kwargs)

        return wrapper

    for name, (module, attribute) in names.items():
        state["originals"][attribute] = getattr(module, attribute)
        setattr(module, attribute, recording(name, getattr(module, attribute)))
    return state["tokens"]


@pytest.mark.timeout(200)
def test_reward_model_and_weighted_python_rewards(cluster, tmp_path):
    """PPO with a reward model and a reference: the rewards combine, and ``max_tokens_per_micro_batch`` bounds every
    scoring forward (log-probs, values, reward model) as it does the update's, rows kept in their order."""
    build_reward_model(tmp_path)

    def short(prompts, completions, **fields):
        return [float(len(c) <= 3) for c in completions]

    budget = 24
    config = rlkit.PPOConfig(
        model="tiny",
        seed=0,
        prompts_per_step=6,
        group_size=4,
        kl_coef=0.05,
        micro_batch_size=5,
        max_tokens_per_micro_batch=budget,
        data=rlkit.DataConfig(max_prompt_tokens=budget - ROLLOUT.max_new_tokens),
        rollout=ROLLOUT,
        reward_model=rlkit.RewardModelConfig(path=str(tmp_path), weight=0.5),
    )
    trainer = rlkit.Trainer(cluster, config, reward_fn={"short": (short, 2.0)})
    cluster.run(record_forward_tokens, True)
    try:
        batch = trainer.score(trainer.rollout())
    finally:
        recorded = cluster.run(record_forward_tokens, False)
    for rank, tokens in enumerate(recorded):
        for name, counts in tokens.items():
            assert len(counts) > 2 and max(counts) <= budget, f"rank {rank}, {name}: real tokens per forward {counts}"
    texts = [p + c for p, c in zip(batch.prompts, batch.completions, strict=True)]
    torch.testing.assert_close(
        batch.reward_terms["reward_model"], reference_scores(tmp_path, texts), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        batch.rewards, 2.0 * batch.reward_terms["short"] + 0.5 * batch.reward_terms["reward_model"]
    )
    torch.testing.assert_close(batch.ref_logprobs, batch.logprobs)  # the same weights: rows in the same order
    assert batch.logprob_gap_tokens().max() < 1e-4, "the trainer's log-probs are not the engine's rows'"
    assert batch.values is not None and batch.values.isfinite().all()


@pytest.mark.timeout(200)
def test_reward_errors_name_function_and_sample_and_lose_nothing(cluster):
    def too_few(prompts, completions, **fields):
        return [0.0] * (len(completions) - 1)

    def per_token_rloo(x):  # a user's estimator: RLOO on each group, spread over the tokens
        adv = rloo_advantages(x.scores, x.group_size).unsqueeze(1) * x.response_mask
        return adv, adv

    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=4, group_size=4, rollout=ROLLOUT)
    trainer = rlkit.Trainer(cluster, config, advantage_fn=per_token_rloo)
    batch = trainer.rollout()
    target = batch.prompts[9]

    calls = []

    def picky(prompts, completions, **fields):
        calls.append(len(prompts))
        if target in prompts:
            raise ZeroDivisionError("no answer for this one")
        return [0.0] * len(completions)

    trainer.reward_fn = [addition_reward, picky]
    with pytest.raises(RewardError) as err:
        trainer.step(batch)
    text = str(err.value)
    assert "'picky' raised ZeroDivisionError: no answer for this one" in text
    assert "(at test_ppo.py:" in text and 'in picky: raise ZeroDivisionError("no answer for this one"))' in text
    assert calls == [16], "a function that raised is called again (an API judge would pay for every sample)"
    assert "trainer.step(trainer.last_batch)" in "".join(err.value.__notes__)
    assert trainer.last_batch is batch and batch.rewards is None and trainer.steps_done == 0 and trainer.history.empty
    trainer.reward_fn = [addition_reward, too_few]
    with pytest.raises(RewardError, match=r"'too_few' returned 15 values for 16 completions"):
        trainer.step(trainer.last_batch)
    trainer.reward_fn = addition_reward
    row = trainer.step(trainer.last_batch)
    assert trainer.last_batch is batch and row["step"] == 1 and len(trainer.history) == 1
    torch.testing.assert_close(batch.advantages, rloo_advantages(batch.rewards, 4).unsqueeze(1) * batch.response_mask)


@pytest.mark.timeout(200)
def test_grpo_family_settings_run_through_the_trainer(cluster):
    from rlkit.algos import compute_advantages
    from rlkit.trainer.advantages import advantage_inputs

    config = rlkit.GRPOConfig(
        model="tiny",
        seed=2,
        prompts_per_step=4,
        group_size=2,
        advantage="reinforce++",
        gamma=0.9,
        kl_coef=0.05,
        kl_mode="reward",
        kl_estimator="k1",
        loss_agg="seq-mean-token-sum-norm",
        clip_high=0.28,
        dual_clip=3.0,
        entropy_coef=0.01,
        ppo_epochs=2,
        rollout=ROLLOUT,
        optim=rlkit.OptimConfig(lr=1e-3),
    )
    trainer = rlkit.Trainer(cluster, config)
    trainer.step()
    row = trainer.step()
    batch = trainer.last_batch
    expected, returns = compute_advantages("reinforce++", advantage_inputs(batch, config))
    assert torch.equal(batch.advantages, expected) and torch.equal(batch.returns, returns)
    assert row["kl/mean"] > 0 and row["actor/kl_loss"] == 0.0  # the KL is in the reward, not the loss
    assert all(torch.isfinite(torch.tensor(v)) for k, v in row.items() if k.startswith(("actor/", "critic/")))
