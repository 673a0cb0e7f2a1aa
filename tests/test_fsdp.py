"""The FSDP training engine on 2 gloo workers against an unsharded single-process reference."""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlkit
from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.models.logprobs import response_logprobs

WIDTH = 4  # response tokens
CLIP, KL, LR = 0.2, 0.05, 1e-3
TINY_GRAD = 1e-6
"""Gradient entries below this (before clipping, which scales them down further) are within a few
hundred float-noise units of AdamW's eps = 1e-8, where its first step (about lr * g / (|g| + eps))
turns a change in the order of a reduction (packed vs padded rows, micro-batch splits) into a visible
change of the weight, or of its sign: such entries are held to within 2 * lr."""


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
        "logprobs": -4.5 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "ref_logprobs": -4.2 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "advantages": torch.randn(n, generator=gen),
    }


def config(version: int, micro: int) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        clip_eps=CLIP,
        kl_coef=KL,
        micro_batch_size=micro,
        rollout=rlkit.RolloutConfig(max_new_tokens=WIDTH),
        optim=rlkit.OptimConfig(lr=LR, max_grad_norm=0.5),
        fsdp=rlkit.FSDPConfig(version=version),
    )


@dataclasses.dataclass
class Reference:
    loss: float
    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    """Before clipping."""
    lr: float = LR

    def assert_matches(self, weights: dict[str, torch.Tensor], label: str) -> None:
        """Every weight as after the reference's AdamW step (entries with TINY_GRAD gradients: within 2 lr)."""
        assert weights.keys() == self.weights.keys()
        for name, ref in self.weights.items():
            noise = self.grads[name].abs() < TINY_GRAD
            got = weights[name]
            torch.testing.assert_close(got[~noise], ref[~noise], rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")
            assert ((got[noise] - ref[noise]).abs() <= 2 * self.lr).all(), f"{label}: {name}"


def reference_update() -> Reference:
    """Plain PyTorch: one model, the whole batch, token-mean loss, clipped norm, one AdamW step."""
    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logp, _ = response_logprobs(model, ids, mask, response_width=WIDTH, temperature=1.0)
    per_token, _ = clipped_policy_loss(logp, batch["logprobs"], batch["advantages"], CLIP)
    per_token = per_token + KL * kl_estimate(logp, batch["ref_logprobs"], "k3")
    mask = batch["response_mask"]
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return Reference(loss.item(), {k: v.detach() for k, v in model.named_parameters()}, grads)


def sharded_update(version: int, micro: int) -> dict:
    """On a worker: the same update through rlkit's Actor, this rank holding half the batch."""
    import torch.distributed as dist

    from rlkit.fsdp import build_mesh, iter_full_params
    from rlkit.runtime import context
    from rlkit.trainer.actor import STAT_NAMES, Actor

    ctx = context()
    cfg = config(version, micro)
    actor = Actor(small_model(), build_mesh("cpu", ctx.world_size, cfg.fsdp), cfg)
    half = make_batch()["input_ids"].shape[0] // ctx.world_size
    shard = {k: v[ctx.rank * half : (ctx.rank + 1) * half] for k, v in make_batch().items()}
    sums, _ = actor.train_step(shard)
    dist.all_reduce(sums)
    return {
        "loss": dict(zip(STAT_NAMES, sums.tolist(), strict=True))["loss"],
        "weights": dict(iter_full_params(actor.model)),
    }


@pytest.fixture(scope="module")
def cluster():
    with rlkit.launch(world_size=2) as c:
        yield c


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", [2, 1])
def test_sharded_update_equals_unsharded_reference(cluster, version):
    reference = reference_update()
    results = cluster.run(sharded_update, version, 64)
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(reference.loss, rel=1e-5, abs=1e-6)
        reference.assert_matches(result["weights"], f"rank {rank}")


@pytest.mark.timeout(120)
def test_gradient_accumulation_invariance(cluster):
    """1 micro-batch of 4 per rank (8 in all) and micro-batches of 1 give the same update (the reference's:
    rows packed 4 at a time round differently from rows alone, which AdamW's first step amplifies on
    gradients at noise level, so those entries are held as :meth:`Reference.assert_matches` holds them)."""
    whole = cluster.run(sharded_update, 2, 4)[0]
    accumulated = cluster.run(sharded_update, 2, 1)[0]
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    reference = reference_update()
    reference.assert_matches(whole["weights"], "micro-batch 4")
    reference.assert_matches(accumulated["weights"], "micro-batch 1")


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
def test_other_strategies_match_reference(cluster, fsdp):
    def run(fsdp):
        import torch.distributed as dist

        from rlkit.fsdp import build_mesh, iter_full_params
        from rlkit.runtime import context
        from rlkit.trainer.actor import Actor

        ctx = context()
        cfg = dataclasses.replace(config(fsdp.version, 64), fsdp=fsdp)
        actor = Actor(small_model(), build_mesh("cpu", ctx.world_size, fsdp), cfg)
        shard = {k: v[ctx.rank * 4 : (ctx.rank + 1) * 4] for k, v in make_batch().items()}
        actor.train_step(shard)
        dist.barrier()
        return dict(iter_full_params(actor.model))

    reference = reference_update()
    for rank, weights in enumerate(cluster.run(run, fsdp)):
        reference.assert_matches(weights, f"rank {rank}")


def test_cluster_dependent_config_problems():
    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.GRPOConfig(fsdp=rlkit.FSDPConfig(sharding="hybrid", hybrid_shard_size=3, cpu_offload=True)).check_cluster(
            4, "cpu"
        )
    assert "hybrid_shard_size=3 does not divide world_size=4" in str(err.value)
    assert "cpu_offload=True on a CPU cluster" in str(err.value)


def test_lr_schedule():
    from rlkit.trainer.optim import lr_factor

    warm = [lr_factor(s, warmup=4, total=10, schedule="constant", min_ratio=0.0) for s in range(6)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, warmup=0, total=5, schedule="cosine", min_ratio=0.1) for s in range(5)]
    assert cos[0] == pytest.approx(1.0) and cos[2] == pytest.approx(0.55) and cos[4] == pytest.approx(0.1)
