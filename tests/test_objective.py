"""The actor's objective and the critic on 2 gloo workers, against unsharded single-process references.

Every loss aggregation mode must give the same update whatever the split over ranks and
micro-batches (rank 0 holds fewer response tokens than rank 1 here, so local normalisers
would be wrong).
"""

import pytest
import torch
from role_runs import assert_adam_step_matches, save_model_dir
from test_fsdp import WIDTH, small_model

import rlkit
from rlkit.algos import (
    Correction,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    correction_weights,
    engine_log_ratio,
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    mismatch_summary,
)
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
        "old_logprobs": -4.5 + 0.5 * torch.randn(n, WIDTH, generator=gen),
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


def policy_reference(mode: str) -> tuple[float, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole batch in one process: per-token PPO loss + k2 KL - entropy bonus, aggregated by ``mode``."""
    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    logits = response_logits(model, batch["input_ids"], batch["attention_mask"], WIDTH).float() / TEMPERATURE
    logp = token_logprobs(logits, batch["input_ids"][:, -WIDTH:], 1.0)
    per_token, clipped = clipped_policy_loss(
        logp, batch["old_logprobs"], batch["advantages"], 0.2, clip_high=0.28, dual_clip=3.0
    )
    per_token = per_token + 0.05 * kl_estimate(logp, batch["ref_logprobs"], "k2") - 0.01 * entropy_from_logits(logits)
    loss = aggregate_loss(per_token, batch["response_mask"], mode)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}  # as AdamW takes them
    optimizer.step()
    clipfrac = masked_mean(clipped, batch["response_mask"]).item()
    return loss.item(), clipfrac, {k: v.detach() for k, v in model.named_parameters()}, grads


def sharded_policy_update(model_dir: str, mode: str, micro: int, policy_loss_fn=None) -> dict:
    """On a worker: the same update through rlkit's PolicyWorker, this rank holding half the batch."""
    from role_runs import policy_update

    return policy_update(model_dir, config(mode, micro), make_batch(), policy_loss_fn)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model_dir(small_model(), tmp_path_factory.mktemp("small"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
)
def test_policy_update_matches_reference_in_every_mode_and_split(cluster, model_dir, mode):
    ref_loss, ref_clipfrac, ref_weights, ref_grads = policy_reference(mode)
    assert 0 < ref_clipfrac < 1
    for micro in (1, 3):
        for rank, result in enumerate(cluster.run(sharded_policy_update, model_dir, mode, micro)):
            metrics, label = result["metrics"], f"{mode} micro={micro} rank={rank}"
            assert metrics["actor/loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), label
            assert metrics["actor/clipfrac"] == pytest.approx(ref_clipfrac, rel=1e-6), label
            assert_adam_step_matches(result["weights"], ref_weights, ref_grads, 1e-3, label)


@pytest.mark.timeout(120)
def test_custom_policy_loss_travels_by_value(cluster, model_dir):
    def reinforce(logprobs, old_logprobs, advantages, response_mask):  # defined here: pickled by value
        return -advantages * logprobs, torch.zeros_like(logprobs)

    model, batch = small_model(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    logits = response_logits(model, batch["input_ids"], batch["attention_mask"], WIDTH).float() / TEMPERATURE
    logp = token_logprobs(logits, batch["input_ids"][:, -WIDTH:], 1.0)
    per_token = -batch["advantages"] * logp + 0.05 * kl_estimate(logp, batch["ref_logprobs"], "k2")
    per_token = per_token - 0.01 * entropy_from_logits(logits)
    aggregate_loss(per_token, batch["response_mask"], "token-mean").backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}  # as AdamW takes them
    optimizer.step()
    expected = {k: v.detach() for k, v in model.named_parameters()}
    for rank, result in enumerate(cluster.run(sharded_policy_update, model_dir, "token-mean", 2, reinforce)):
        assert_adam_step_matches(result["weights"], expected, grads, 1e-3, f"rank {rank}")
        assert result["metrics"]["actor/clipfrac"] == 0.0


CORRECTION = {"weight": "token", "weight_cap": 1.3, "mask": "geometric", "mask_low": 0.9, "mask_high": 1.1}


def with_engine(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with engine log-probs near the old ones (some geometric means leave [0.9, 1.1])."""
    gen = torch.Generator().manual_seed(3)
    return {**batch, "rollout_logprobs": batch["old_logprobs"] + 0.25 * torch.randn(8, WIDTH, generator=gen)}


def engine_update(model_dir: str, correction: dict | None) -> dict:
    """On a worker: an update given the engine's log-probs, with ``correction`` (None: off)."""
    import dataclasses

    from role_runs import policy_update

    cfg = config("token-mean", 3)
    if correction is not None:
        cfg = dataclasses.replace(cfg, rollout_correction=rlkit.RolloutCorrectionConfig(**correction))
    return policy_update(model_dir, cfg, with_engine(make_batch()))


@pytest.mark.timeout(120)
def test_engine_logprobs_with_correction_off_leave_the_update_bit_for_bit(cluster, model_dir):
    plain = cluster.run(sharded_policy_update, model_dir, "token-mean", 3)
    measured = cluster.run(engine_update, model_dir, None)
    batch = with_engine(make_batch())
    for rank in range(2):
        assert measured[rank]["metrics"]["actor/loss"] == plain[rank]["metrics"]["actor/loss"]
        for name, value in plain[rank]["weights"].items():
            assert torch.equal(measured[rank]["weights"][name], value), name
    metrics = measured[0]["metrics"]
    assert metrics == measured[1]["metrics"] and not any(k.startswith("rollout_correction/") for k in metrics)
    whole = mismatch_summary(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"])
    assert metrics["mismatch/kl_k3"] == pytest.approx(whole["kl_k3"], rel=1e-5)
    assert metrics["mismatch/abs_delta/max"] == pytest.approx(whole["abs_delta_max"], rel=1e-5)
    assert metrics["mismatch/ratio/min"] == pytest.approx(whole["ratio_min"], rel=1e-5)
    for rank, rows in enumerate((slice(0, 4), slice(4, 8))):
        part = mismatch_summary(*(batch[k][rows] for k in ("old_logprobs", "rollout_logprobs", "response_mask")))
        assert metrics[f"mismatch/rank{rank}/kl_k3"] == pytest.approx(part["kl_k3"], rel=1e-5)
        assert metrics[f"mismatch/rank{rank}/abs_delta/max"] == pytest.approx(part["abs_delta_max"], rel=1e-5)


@pytest.mark.timeout(120)
def test_corrected_update_matches_reference(cluster, model_dir):
    model, batch = small_model(), with_engine(make_batch())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    logits = response_logits(model, batch["input_ids"], batch["attention_mask"], WIDTH).float() / TEMPERATURE
    logp = token_logprobs(logits, batch["input_ids"][:, -WIDTH:], 1.0)
    per_token, _ = clipped_policy_loss(logp, batch["old_logprobs"], batch["advantages"], 0.2, clip_high=0.28,
                                       dual_clip=3.0)  # fmt: skip
    delta, checked = engine_log_ratio(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"])
    result = correction_weights(delta, checked, Correction(**CORRECTION))
    assert 0 < result.rejected.float().mean() < 0.9 and result.truncated.any()  # the case exercises both
    per_token = result.weights * per_token + 0.05 * kl_estimate(logp, batch["ref_logprobs"], "k2")
    loss = aggregate_loss(per_token - 0.01 * entropy_from_logits(logits), batch["response_mask"], "token-mean")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    optimizer.step()
    expected = {k: v.detach() for k, v in model.named_parameters()}
    masked = result.rejected.float()[checked].mean().item()
    for rank, got in enumerate(cluster.run(engine_update, model_dir, CORRECTION)):
        assert got["metrics"]["actor/loss"] == pytest.approx(loss.item(), rel=1e-5), rank
        assert got["metrics"]["rollout_correction/masked_frac"] == pytest.approx(masked, rel=1e-6)
        assert_adam_step_matches(got["weights"], expected, grads, 1e-3, f"rank {rank}")


def test_custom_policy_loss_with_wrong_shape_is_named():
    from rlkit.algos import PolicyObjective, policy_objective

    def per_sequence(logprobs, old_logprobs, advantages, response_mask):
        return (-advantages * logprobs).sum(1), torch.zeros(logprobs.shape[0])

    batch = make_batch()
    objective = PolicyObjective(policy_loss_fn=per_sequence)
    expected = r"policy_loss_fn 'per_sequence' must return \(loss, clipped\).*got \(\[8\], \[8\]\)"
    with pytest.raises(ValueError, match=expected):
        policy_objective(
            torch.zeros(8, WIDTH), batch["old_logprobs"], batch["advantages"], batch["response_mask"],
            torch.ones(8, WIDTH), objective,
        )  # fmt: skip


def save_small_model(directory) -> None:
    save_model_dir(small_model(), directory)


def critic_reference(model_dir) -> tuple[torch.Tensor, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rollout-time values, the clipped value loss (token-mean), the weights after one AdamW step and the gradients
    it took, in one process."""
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
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    optimizer.step()
    return rollout_values, loss.item(), {k: v.detach() for k, v in model.named_parameters()}, grads


def sharded_critic(model_dir: str, micro: int, fsdp_version: int) -> dict:
    """On a worker: rlkit's CriticWorker on this rank's half: its values, one update, the gathered weights."""
    from role_runs import critic_run

    return critic_run(model_dir, config("token-mean", micro, fsdp_version), make_batch())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_critic_values_and_update_match_reference(cluster, tmp_path, fsdp_version):
    save_small_model(tmp_path)
    ref_values, ref_loss, ref_weights, ref_grads = critic_reference(tmp_path)
    for micro in (4, 1):
        results = cluster.run(sharded_critic, str(tmp_path), micro, fsdp_version)
        mask = make_batch()["response_mask"]
        values = torch.cat([r["values"] for r in results])
        torch.testing.assert_close(values * mask, ref_values * mask, rtol=1e-5, atol=1e-6)
        for rank, result in enumerate(results):
            assert result["metrics"]["critic/loss"] == pytest.approx(ref_loss, rel=1e-5), f"micro={micro} rank={rank}"
            assert 0 < result["metrics"]["critic/value_clipfrac"] < 1
            assert_adam_step_matches(result["weights"], ref_weights, ref_grads, 2e-3,
                                     f"critic fsdp{fsdp_version} micro={micro} rank={rank}")
