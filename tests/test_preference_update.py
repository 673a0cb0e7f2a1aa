"""PreferenceWorker.update on 2 gloo workers against an unsharded single-process reference written in plain torch.

Two optimizer steps on one hand-made batch (prompts and completions of uneven lengths), so that the second
step's policy differs from the reference: DPO's log-ratios and KTO's baseline z_ref are then not 0. Split over
2 ranks and into micro-batches, the update must give the reference's loss, gradient norm, metrics and weights
(gradient accumulation is exact).
"""

import pytest
import torch
import torch.nn.functional as F
from role_runs import assert_adam_step_matches, save_model_dir
from test_fsdp import small_model

import rlkit
from rlkit.models.logprobs import response_logits, token_logprobs
from rlkit.trainer.assemble import preference_rows

LR, BETA, PAIRS = 1e-3, 0.5, 8


def make_examples() -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """8 prompts of 3-6 tokens, 2 completions each of 1-4 tokens (ids 1..63), and KTO labels (5 of 8 desirable)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (3 + i % 4,), generator=gen).tolist() for i in range(PAIRS)]
    completions = [torch.randint(1, 64, (1 + (i * 5) % 4,), generator=gen).tolist() for i in range(2 * PAIRS)]
    return prompts, completions, [True, False, True, True, False, True, False, True]


def dpo_rows() -> rlkit.workers.PreferenceRows:
    """Pair i: prompt i, chosen completion 2i, rejected completion 2i + 1 (rows 2i and 2i + 1)."""
    prompts, completions, _ = make_examples()
    return preference_rows([p for p in prompts for _ in range(2)], completions, pad_id=0)


def kto_rows() -> tuple[rlkit.workers.PreferenceRows, rlkit.workers.PreferenceRows]:
    """Example i: prompt i with completion i; the mismatched pairs: prompt i with completion i - 1."""
    prompts, completions, labels = make_examples()
    mine = completions[:PAIRS]
    shifted = [mine[i - 1] for i in range(PAIRS)]
    return preference_rows(prompts, mine, 0, labels), preference_rows(prompts, shifted, 0)


def summed_logps(model: torch.nn.Module, rows) -> torch.Tensor:
    """[n] plain padded forward: the completion tokens' log-probs summed."""
    width = rows.response_mask.shape[1]
    logits = response_logits(model, rows.input_ids, rows.attention_mask, width)
    return (token_logprobs(logits, rows.input_ids[:, -width:], 1.0) * rows.response_mask).sum(dim=1)


def reference_run(algorithm: str) -> list[dict]:
    """Two steps in one process: [{loss, grad_norm, z_ref, accuracy, weights, grads}] per step."""
    policy, frozen = small_model(), small_model().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    steps = []
    for _ in range(2):
        optimizer.zero_grad()
        if algorithm.startswith("dpo"):
            rows = dpo_rows()
            with torch.no_grad():  # reference-free DPO takes the reference log-probs as 0
                ratio_ref = torch.zeros(len(rows)) if algorithm == "dpo-reference-free" else summed_logps(frozen, rows)
            ratio = summed_logps(policy, rows) - ratio_ref  # log pi - log pi_ref per completion
            h = ratio[0::2] - ratio[1::2]
            loss, z_ref = -F.logsigmoid(BETA * h).mean(), 0.0
            accuracy = (h.detach() > 0).float().mean().item()
        else:
            rows, mismatched = kto_rows()
            with torch.no_grad():
                z_ref = max(0.0, (summed_logps(policy, mismatched) - summed_logps(frozen, mismatched)).mean().item())
                ratio_ref = summed_logps(frozen, rows)
            ratio = summed_logps(policy, rows) - ratio_ref
            good = rows.desirable
            desirable_loss = 1 - torch.sigmoid(BETA * (ratio - z_ref))
            undesirable_loss = 1 - torch.sigmoid(BETA * (z_ref - ratio))
            loss = torch.where(good, desirable_loss, undesirable_loss).mean()
            accuracy = torch.where(good, ratio > z_ref, ratio < z_ref).float().mean().item()
        loss.backward()
        grads = {k: v.grad.clone() for k, v in policy.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5).item()
        optimizer.step()
        weights = {k: v.detach().clone() for k, v in policy.named_parameters()}
        steps.append(dict(loss=loss.item(), grad_norm=norm, z_ref=z_ref, accuracy=accuracy, weights=weights,
                          grads=grads))  # fmt: skip
    return steps


def config(algorithm: str, micro: int, fsdp_version: int):
    settings = dict(
        batch_size=PAIRS,
        micro_batch_size=micro,
        beta=BETA,
        steps=2,
        fsdp=rlkit.FSDPConfig(version=fsdp_version),
        optim=rlkit.OptimConfig(lr=LR, max_grad_norm=0.5),
    )
    if algorithm == "kto":
        return rlkit.KTOConfig(**settings)
    return rlkit.DPOConfig(**settings, reference_free=algorithm == "dpo-reference-free")


def sharded_run(model_dir: str, algorithm: str, micro: int, fsdp_version: int) -> list[dict]:
    """On a worker: two PreferenceWorker updates on this rank's half of the rows; metrics and gathered weights."""
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import context
    from rlkit.workers import PreferenceWorker

    ctx = context()
    worker = PreferenceWorker(config(algorithm, micro, fsdp_version), model_dir)
    rows, mismatched = kto_rows() if algorithm == "kto" else (dpo_rows(), None)
    share, n = slice(ctx.rank * len(rows) // 2, (ctx.rank + 1) * len(rows) // 2), PAIRS // 2
    mine = None if mismatched is None else mismatched.select(slice(ctx.rank * n, (ctx.rank + 1) * n))
    steps = []
    for _ in range(2):
        result = worker.update(rows.select(share), mine)
        assert (result.reference_logps is None) == (worker.reference is None) == (algorithm == "dpo-reference-free")
        steps.append({"metrics": result.metrics, "weights": dict(iter_full_params(worker.actor.model))})
    worker.close()
    return steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model_dir(small_model(), tmp_path_factory.mktemp("small"))


def noise_level(reference: list[dict], step: int) -> dict[str, torch.Tensor]:
    """Per entry, the smallest |gradient| of the reference's steps so far: an entry whose gradient was float noise
    in any of them may differ by up to 2 lr per step (see role_runs.TINY_GRAD)."""
    return {k: torch.stack([r["grads"][k].abs() for r in reference[: step + 1]]).amin(0) for k in reference[0]["grads"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("algorithm", "fsdp_version"), [("dpo", 2), ("kto", 2), ("dpo-reference-free", 2), ("dpo", 1)]
)
def test_sharded_update_equals_unsharded_reference_for_every_micro_batch_size(
    cluster, model_dir, algorithm, fsdp_version
):
    reference = reference_run(algorithm)
    if algorithm != "dpo-reference-free":  # policy = reference at the first step: every implicit reward is 0
        assert reference[0]["loss"] == pytest.approx(0.6931472 if algorithm == "dpo" else 0.5)  # log 2; 1 - sig(0)
        assert reference[0]["z_ref"] == 0.0 and reference[0]["accuracy"] == 0.0
    if algorithm == "kto":
        assert reference[1]["z_ref"] > 0, "the second step's baseline should not be clamped, or it checks nothing"
    # 4 pairs per rank: micro-batches of 3 + 1 (and for DPO on FSDP2 also 1 + 1 + 1 + 1) against the unsplit reference
    for micro in (3, 1) if (algorithm, fsdp_version) == ("dpo", 2) else (3,):
        for rank, run in enumerate(cluster.run(sharded_run, model_dir, algorithm, micro, fsdp_version)):
            for step, (got, expected) in enumerate(zip(run, reference, strict=True)):
                label = f"{algorithm} fsdp{fsdp_version} micro={micro} rank={rank} step={step + 1}"
                metrics = got["metrics"]
                assert metrics["actor/loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6), label
                assert metrics["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), label
                assert metrics["rewards/accuracy"] == pytest.approx(expected["accuracy"]), label
                if algorithm == "kto":
                    assert metrics["kto/z_ref"] == pytest.approx(expected["z_ref"], rel=1e-5, abs=1e-7), label
                noise = noise_level(reference, step)
                assert_adam_step_matches(got["weights"], expected["weights"], noise, (step + 1) * LR, label)
