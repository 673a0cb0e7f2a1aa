"""The actor's objective and the critic on 2 gloo workers, against unsharded single-process references.

Every loss aggregation mode must give the same update whatever the split over ranks and
micro-batches (rank 0 holds fewer response tokens than rank 1 here, so local normalisers
would be wrong).
"""

import pytest
import torch
from test_fsdp import WIDTH, Reference, small_model

import rlkit
from rlkit.algos import aggregate_loss, clipped_policy_loss, clipped_value_loss, entropy_from_logits, kl_estimate
from rlkit.models.logprobs import response_logits, token_logprobs

TEMPERATURE = 0.7


def make_batch(n: int = 8) -> dict[str, torch.Tensor]:
    """Prompts of 6, responses of 4 with uneven lengths (short ones on rank 0), per-token advantages, old values."""
    gen = torch.Generator().manual_seed(2)
    response_mask = torch.ones(n, WIDTH)
    response_mask[:3, 1:] = 0
    response_mask[5, 3:] = 0
    attention_mask = torch.cat([torch.ones(n, 6, dtype=torch.long), response_mask.long()], dim=1)
    attention_mask[::3, :2] = 0
    return {
        "input_ids": torch.randint(1, 64, (n, 6 + WIDTH), generator=gen),
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "logprobs": -4.5 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "ref_logprobs": -4.2 + 0.5 * torch.randn(n, WIDTH, generator=gen),
        "advantages": torch.randn(n, WIDTH, generator=gen) * response_mask,
        "values": 0.3 * torch.randn(n, WIDTH, generator=gen),
        "returns": torch.randn(n, WIDTH, generator=gen),
    }


def config(mode: str, micro: int, fsdp_version: int = 2) -> rlkit.PPOConfig:
    return rlkit.PPOConfig(
        fsdp=rlkit.FSDPConfig(version=fsdp_version),
        prompts_per_step=8, micro_batch_size=micro, loss_agg=mode, clip_eps=0.2, clip_high=0.28, dual_clip=3.0,
        kl_coef=0.05, kl_mode="loss", kl_estimator="k2", entropy_coef=0.01,
        rollout=rlkit.RolloutConfig(max_new_tokens=WIDTH, temperature=TEMPERATURE),
        optim=rlkit.OptimConfig(lr=1e-3, max_grad_norm=0.5),
        critic=rlkit.CriticConfig(value_clip=0.1, optim=rlkit.OptimConfig(lr=2e-3, max_grad_norm=0.5)),
    )


def policy_reference(mode: str) -> Reference:
    """The whole batch in one process: per-token PPO loss + k2 KL - entropy bonus, aggregated by ``mode``."""
    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    logits = response_logits(model, batch["input_ids"], batch["attention_mask"], WIDTH).float() / TEMPERATURE
    logp = token_logprobs(logits, batch["input_ids"][:, -WIDTH:], 1.0)
    per_token, _ = clipped_policy_loss(logp, batch["logprobs"], batch["advantages"], 0.2, clip_high=0.28, dual_clip=3.0)
    per_token = per_token + 0.05 * kl_estimate(logp, batch["ref_logprobs"], "k2") - 0.01 * entropy_from_logits(logits)
    loss = aggregate_loss(per_token, batch["response_mask"], mode)
    return stepped(model, optimizer, loss)


def stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float = 1e-3):
    """Backward, clip to 0.5, one step; the loss, updated weights and unclipped gradients."""
    loss.backward()
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return Reference(loss.item(), {k: v.detach() for k, v in model.named_parameters()}, grads, lr)


def sharded_policy_update(mode: str, micro: int, policy_loss_fn=None) -> dict:
    """On a worker: the same update through rlkit's Actor, this rank holding half the batch."""
    import torch.distributed as dist

    from rlkit.fsdp import build_mesh, iter_full_params
    from rlkit.runtime import context
    from rlkit.trainer.actor import STAT_NAMES, Actor

    ctx = context()
    cfg = config(mode, micro)
    actor = Actor(small_model(), build_mesh("cpu", ctx.world_size, cfg.fsdp), cfg, policy_loss_fn)
    half = 8 // ctx.world_size
    shard = {k: v[ctx.rank * half : (ctx.rank + 1) * half] for k, v in make_batch().items()}
    sums, _ = actor.train_step(shard)
    dist.all_reduce(sums)
    return {"stats": dict(zip(STAT_NAMES, sums.tolist(), strict=True)), "weights": dict(iter_full_params(actor.model))}


@pytest.fixture(scope="module")
def cluster():
    with rlkit.launch(world_size=2) as c:
        yield c


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_update_matches_reference_in_every_mode_and_split(cluster, mode):
    reference = policy_reference(mode)
    for micro in (1, 3):
        for rank, result in enumerate(cluster.run(sharded_policy_update, mode, micro)):
            label = f"{mode} micro={micro} rank={rank}"
            assert result["stats"]["loss"] == pytest.approx(reference.loss, rel=1e-5, abs=1e-6), label
            reference.assert_matches(result["weights"], label)
            assert result["stats"]["tokens"] == make_batch()["response_mask"].sum().item()


@pytest.mark.timeout(120)
def test_custom_policy_loss_travels_by_value(cluster):
    def reinforce(logprobs, old_logprobs, advantages, response_mask):  # defined here: pickled by value
        return -advantages * logprobs, torch.zeros_like(logprobs)

    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    logits = response_logits(model, batch["input_ids"], batch["attention_mask"], WIDTH).float() / TEMPERATURE
    logp = token_logprobs(logits, batch["input_ids"][:, -WIDTH:], 1.0)
    per_token = -batch["advantages"] * logp + 0.05 * kl_estimate(logp, batch["ref_logprobs"], "k2")
    per_token = per_token - 0.01 * entropy_from_logits(logits)
    reference = stepped(model, optimizer, aggregate_loss(per_token, batch["response_mask"], "token-mean"))
    for rank, result in enumerate(cluster.run(sharded_policy_update, "token-mean", 2, reinforce)):
        reference.assert_matches(result["weights"], f"rank {rank}")
        assert result["stats"]["clipped"] == 0.0


def test_custom_policy_loss_with_wrong_shape_is_named():
    from rlkit.trainer.objective import PolicyObjective

    def per_sequence(logprobs, old_logprobs, advantages, response_mask):
        return (-advantages * logprobs).sum(1), torch.zeros(logprobs.shape[0])

    batch = make_batch()
    micro = {k: batch[k] for k in ("response_mask", "logprobs", "advantages")}
    objective = PolicyObjective(config("token-mean", 8), per_sequence)
    expected = r"policy_loss_fn 'per_sequence' must return \(loss, clipped\).*got \(\[8\], \[8\]\)"
    with pytest.raises(ValueError, match=expected):
        objective(torch.zeros(8, WIDTH), torch.zeros(8, WIDTH), micro, torch.ones(8, WIDTH))


def save_small_model(directory: str) -> None:
    small_model().save_pretrained(directory)


def critic_reference(model_dir) -> tuple[torch.Tensor, Reference]:
    """Rollout-time values, the clipped value loss (token-mean) and the weights after one AdamW step, in one process."""
    from rlkit.models.value import load_value_model, response_values

    torch.manual_seed(0)  # the critic seeds with config.seed before drawing its value head
    model = load_value_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    batch = make_batch()
    with torch.no_grad():
        rollout_values = response_values(model, batch["input_ids"], batch["attention_mask"], response_width=WIDTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    values = response_values(model, batch["input_ids"], batch["attention_mask"], response_width=WIDTH)
    per_token, _ = clipped_value_loss(values, batch["values"], batch["returns"], 0.1)
    loss = aggregate_loss(per_token, batch["response_mask"], "token-mean")
    return rollout_values, stepped(model, optimizer, loss, lr=2e-3)


def sharded_critic(model_dir: str, micro: int, fsdp_version: int) -> dict:
    """On a worker: rlkit's Critic on this rank's half: its values, one train step, the gathered weights."""
    import torch.distributed as dist

    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import context
    from rlkit.trainer.critic import CRITIC_STATS, Critic

    ctx = context()
    critic = Critic(config("token-mean", micro, fsdp_version), model_dir)
    shard = {k: v[ctx.rank * 4 : (ctx.rank + 1) * 4] for k, v in make_batch().items()}
    values = critic.values(shard["input_ids"], shard["attention_mask"])
    keys = ("input_ids", "attention_mask", "response_mask", "values", "returns")
    sums, _ = critic.train_step({k: shard[k] for k in keys})
    dist.all_reduce(sums)
    stats = dict(zip(CRITIC_STATS, sums.tolist(), strict=True))
    return {"values": values, "stats": stats, "weights": dict(iter_full_params(critic.model))}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_critic_values_and_update_match_reference(cluster, tmp_path, fsdp_version):
    save_small_model(tmp_path)
    ref_values, reference = critic_reference(tmp_path)
    for micro in (4, 1):
        results = cluster.run(sharded_critic, str(tmp_path), micro, fsdp_version)
        mask = make_batch()["response_mask"]
        values = torch.cat([r["values"] for r in results])
        torch.testing.assert_close(values * mask, ref_values * mask, rtol=1e-5, atol=1e-6)
        for rank, result in enumerate(results):
            assert result["stats"]["loss"] == pytest.approx(reference.loss, rel=1e-5), f"micro={micro} rank={rank}"
            assert 0 < result["stats"]["clipped"] < mask.sum().item()
            reference.assert_matches(result["weights"], f"critic fsdp{fsdp_version} micro={micro} rank={rank}")
