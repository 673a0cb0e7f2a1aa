"""trainer.sharding() / memory() / grad_norms() / lint() / rollouts() on 2 gloo workers, with a small Qwen2 built
from a config here (random weights, a byte-level tokenizer), so no model files are needed."""

from __future__ import annotations

import pytest
import torch

import rlkit
from rlkit.runtime import context

MiB = 2**20
PHASES = ["rollout", "actor_logprobs", "reference", "forward_backward", "optimizer_step", "weight_sync"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2")
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trainer(model_dir, cpu_cluster):
    config = rlkit.GRPOConfig(model=str(model_dir), seed=0, prompts_per_step=4, group_size=2, kl_coef=0.01,
                              rollout=rlkit.RolloutConfig(max_new_tokens=4))
    prompts = [{"prompt": f"{a}+{a}="} for a in range(8)]
    return rlkit.Trainer(cpu_cluster, config, prompts=prompts,
                         reward_fn=lambda prompts, completions: [float(len(c)) for c in completions])


def engine_bytes(model_dir) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])


@pytest.mark.timeout(300)
def test_trainer_diagnostics_after_a_step(trainer, model_dir):
    with pytest.raises(RuntimeError, match="no update has run yet"):
        trainer.grad_norms()
    row = trainer.step()

    rollouts = trainer.rollouts()
    assert list(rollouts["rank"]) == [0] * 4 + [1] * 4
    assert {"advantage", "finish_reason", "logprob_gap_mean", "reward/<lambda>"} <= set(rollouts.columns)

    sharding = trainer.sharding()
    assert sorted(sharding.units["name"]) == ["(root)", "model.layers.0", "model.layers.1"]
    assert sharding.unwrapped == []
    assert sorted(set(sharding.totals["role"])) == ["engine", "model", "reference"]
    assert sharding.scaling["vs_ideal"].iloc[-1] < 1.05  # the actor's parameters, gradients, AdamW state: halved

    memory = trainer.memory()
    for rank in (0, 1):
        mine = memory[memory["rank"] == rank]
        assert list(mine["phase"]) == PHASES
        actor_mb = sharding.units[f"rank{rank}_mb"].sum()
        assert mine["parameters_mb"].tolist() == pytest.approx([2 * actor_mb] * len(PHASES))  # actor + reference
        assert (mine["engine_mb"] * MiB).tolist() == [engine_bytes(model_dir)] * len(PHASES)
        assert mine.set_index("phase").loc["optimizer_step", "optimizer_mb"] > 0

    norms = trainer.grad_norms()
    assert norms.ok, norms.mismatches
    assert norms.global_norm == pytest.approx(row["actor/grad_norm"], rel=1e-5)  # one optimizer step: the same norm
    assert norms.ranks["loss"].tolist() == pytest.approx([row["actor/loss"]] * 2)

    assert len(trainer.lint()) == 0, str(trainer.lint())


def test_the_plan_and_the_estimate_of_a_cpu_run(trainer):
    """On CPU nothing is sized and the unset switches run off; the estimate is a GPU's, so it wants a size."""
    assert "CPU cluster, nothing sized" in trainer.plan.line and trainer.config.fsdp.compile is False
    est = trainer.estimate(device_memory_gib=79.2)
    assert est.fits and est.setting.device_memory_gib == 79.2 and est.setting.world_size == 2
    with pytest.raises(ValueError, match="give device_memory_gib"):
        trainer.estimate()


def break_sync_on_rank1() -> None:
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    if context().rank == 1:
        with torch.no_grad():
            local_instance(PolicyWorker).engine.model.lm_head.weight[3, 5] += 1e-3


@pytest.mark.timeout(120)
def test_lint_names_the_rank_whose_engine_missed_a_weight_sync(trainer):
    trainer.cluster.run(break_sync_on_rank1)
    findings = trainer.lint()
    assert findings.ids == ["ranks-differ"] and findings.items[0].ranks == (1,)
    assert "engine:model.embed_tokens.weight on rank 1" in findings.items[0].evidence
