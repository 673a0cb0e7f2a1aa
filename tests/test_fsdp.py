"""The FSDP training engine on 2 gloo workers against an unsharded single-process reference."""

import dataclasses

import pytest
import torch
from role_runs import assert_adam_step_matches, save_model_dir
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlkit
from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.models.logprobs import response_logprobs

WIDTH = 4  # response tokens
CLIP, KL, LR = 0.2, 0.05, 1e-3


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def make_batch(n: int = 8) -> dict[str, torch.Tensor]:
    """Prompts of 6 (left-padded), responses of 4 (right-padded); old log-probs off-policy so clipping acts."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (n, 6 + WIDTH), generator=gen)
    attention_mask = torch.ones(n, 6 + WIDTH, dtype=torch.long)
    attention_mask[::3, :2] = 0
    response_mask = torch.ones(n, WIDTH)
    response_mask[1::2, -1] = 0
    attention_mask[:, 6:] = response_mask.long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "old_logprobs": -4.5 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "ref_logprobs": -4.2 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "advantages": torch.randn(n, generator=gen),
    }


def config(version: int, micro: int, max_tokens: int = 0) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        clip_eps=CLIP,
        kl_coef=KL,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=max_tokens,
        rollout=rlkit.RolloutConfig(max_new_tokens=WIDTH),
        data=rlkit.DataConfig(max_prompt_tokens=6),
        optim=rlkit.OptimConfig(lr=LR, max_grad_norm=0.5),
        fsdp=rlkit.FSDPConfig(version=version),
    )


@dataclasses.dataclass
class Reference:
    loss: float
    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    """After clipping: what AdamW stepped on."""

    def assert_matches(self, weights: dict[str, torch.Tensor], label: str) -> None:
        """Every weight as after the reference's AdamW step (entries with float-noise gradients: within 2 lr)."""
        assert_adam_step_matches(weights, self.weights, self.grads, LR, label)


def reference_update() -> Reference:
    """Plain PyTorch: one model, the whole batch, token-mean loss, clipped norm, one AdamW step."""
    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logp, _ = response_logprobs(model, ids, mask, response_width=WIDTH, temperature=1.0)
    per_token, _ = clipped_policy_loss(logp, batch["old_logprobs"], batch["advantages"], CLIP)
    per_token = per_token + KL * kl_estimate(logp, batch["ref_logprobs"], "k3")
    mask = batch["response_mask"]
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}  # as AdamW takes them
    optimizer.step()
    return Reference(loss.item(), {k: v.detach() for k, v in model.named_parameters()}, grads)


def sharded_update(model_dir: str, version: int, micro: int, max_tokens: int = 0) -> dict:
    """On a worker: the same update through rlkit's PolicyWorker, this rank holding half the batch."""
    from role_runs import policy_update

    result = policy_update(model_dir, config(version, micro, max_tokens), make_batch())
    return {"loss": result["metrics"]["actor/loss"], "weights": result["weights"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model_dir(small_model(), tmp_path_factory.mktemp("small"))


@pytest.mark.numeric
@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", [2, 1])
def test_sharded_update_equals_unsharded_reference(cluster, model_dir, version):
    reference = reference_update()
    results = cluster.run(sharded_update, model_dir, version, 64)
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(reference.loss, rel=1e-5, abs=1e-6)
        reference.assert_matches(result["weights"], f"rank {rank}")


@pytest.mark.timeout(120)
def test_gradient_accumulation_invariance(cluster, model_dir):
    """1 micro-batch of 4 per rank (8 in all) and micro-batches of 1 give the same update."""
    whole = cluster.run(sharded_update, model_dir, 2, 4)[0]
    accumulated = cluster.run(sharded_update, model_dir, 2, 1)[0]
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert_adam_step_matches(accumulated["weights"], whole["weights"], reference_update().grads, LR, "micro=1")


def kept_update(model_dir: str, version: int, keep: bool) -> dict:
    """On a worker: micro-batches of 1 with FSDP's units kept gathered through the step or not; the weights, and
    whether the first layer's weight was still a sharded DTensor as each micro-batch began and after the update
    and a no-grad forward (FSDP2 registers its unsharded parameters as plain tensors while gathered)."""
    from role_runs import rank_share
    from torch.distributed.tensor import DTensor

    from rlkit.fsdp import iter_full_params
    from rlkit.workers import PolicyRows, PolicyWorker

    worker = PolicyWorker(config(version, 1), model_dir)
    worker.actor.keep_unsharded = keep
    layer = worker.actor.model.model.layers[0].self_attn.q_proj
    sharded, new_logprobs = [], worker._new_logprobs
    worker._new_logprobs = lambda micro: sharded.append(isinstance(layer.weight, DTensor)) or new_logprobs(micro)
    share = rank_share(make_batch())
    worker.update(PolicyRows(**{k: v for k, v in share.items() if k != "advantages"}, advantages=share["advantages"]))
    after_update = isinstance(layer.weight, DTensor)
    worker._scored_logprobs(worker.actor.model, share["input_ids"], share["attention_mask"])
    weights = dict(iter_full_params(worker.actor.model))
    return {"sharded": sharded, "after": [after_update, isinstance(layer.weight, DTensor)], "weights": weights}


@pytest.mark.timeout(120)
def test_units_kept_gathered_through_the_micro_batches_give_the_same_update(cluster, model_dir):
    """FSDP2 gathers once per step (the first micro-batch) where the units are kept, every micro-batch where
    not, reshards after both, and the updates agree; FSDP1's no_sync (fp32 on CPU) agrees too."""
    grads = reference_update().grads
    kept, plain = (cluster.run(kept_update, model_dir, 2, keep)[0] for keep in (True, False))
    assert kept["sharded"] == [True, False, False, False] and plain["sharded"] == [True] * 4
    assert kept["after"] == plain["after"] == [True, True]  # resharded after the update and after a forward
    assert_adam_step_matches(kept["weights"], plain["weights"], grads, LR, "kept gathered")
    fsdp1 = [cluster.run(kept_update, model_dir, 1, keep)[0]["weights"] for keep in (True, False)]
    assert_adam_step_matches(fsdp1[0], fsdp1[1], grads, LR, "FSDP1 no_sync")
    assert_adam_step_matches(fsdp1[0], plain["weights"], grads, LR, "FSDP1 against FSDP2")


@pytest.mark.timeout(120)
def test_token_budget_micro_batches_give_the_update_of_one_big_batch(cluster, model_dir):
    """Micro-batches of at most 10 or 20 real tokens (rows of 8 to 10: 1 or 2 rows each, reordered longest first)
    give the update of the whole batch in one micro-batch."""
    reference = reference_update()
    for budget in (10, 20):
        for rank, result in enumerate(cluster.run(sharded_update, model_dir, 2, 64, budget)):
            assert result["loss"] == pytest.approx(reference.loss, rel=1e-5, abs=1e-6), f"budget {budget}"
            reference.assert_matches(result["weights"], f"budget {budget}, rank {rank}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fsdp",
    [
        rlkit.FSDPConfig(sharding="no_shard"),
        rlkit.FSDPConfig(sharding="hybrid", hybrid_shard_size=1),
        rlkit.FSDPConfig(version=1, sharding="no_shard"),
        rlkit.FSDPConfig(version=1, reshard_after_forward=False, backward_prefetch="post"),
    ],
    ids=["fsdp2-no_shard", "fsdp2-hybrid", "fsdp1-no_shard", "fsdp1-grad_op"],
)
def test_other_strategies_match_reference(cluster, model_dir, fsdp):
    def run(model_dir, fsdp):
        from role_runs import policy_update

        cfg = dataclasses.replace(config(fsdp.version, 64), fsdp=fsdp)
        return policy_update(model_dir, cfg, make_batch())["weights"]

    reference = reference_update()
    for rank, weights in enumerate(cluster.run(run, model_dir, fsdp)):
        reference.assert_matches(weights, f"rank {rank}")


def test_cluster_dependent_config_problems():
    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.GRPOConfig(fsdp=rlkit.FSDPConfig(sharding="hybrid", hybrid_shard_size=3, cpu_offload=True)).check_cluster(
            4, "cpu"
        )
    assert "hybrid_shard_size=3 does not divide world_size=4" in str(err.value)
    assert "cpu_offload=True on a CPU cluster" in str(err.value)


def test_lr_schedule():
    from rlkit.workers.optim import lr_factor

    warm = [lr_factor(s, warmup=4, total=10, schedule="constant", min_ratio=0.0) for s in range(6)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, warmup=0, total=5, schedule="cosine", min_ratio=0.1) for s in range(5)]
    assert cos[0] == pytest.approx(1.0) and cos[2] == pytest.approx(0.55) and cos[4] == pytest.approx(0.1)
    kinds = ("cosine", "constant")
    past = [lr_factor(s, warmup=0, total=5, schedule=kind, min_ratio=0.1) for kind in kinds for s in (5, 50)]
    assert past == pytest.approx([0.1, 0.1, 1.0, 1.0])  # past the schedule: its last value, held


def test_clean_name_drops_every_wrapper_segment():
    """One clean_name for the weight sync and the diagnostics: FSDP1, activation checkpointing and compile."""
    from rlkit.fsdp.full_params import clean_name

    wrapped = "_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.up_proj.weight"
    assert clean_name(wrapped) == "model.layers.0.mlp.up_proj.weight"
    assert clean_name("model.layers.0._fsdp_wrapped_module") == "model.layers.0"
    assert clean_name("_fsdp_wrapped_module") == ""
    assert clean_name("lm_head.weight") == "lm_head.weight"
