"""Training-inference mismatch on 2 gloo workers with the hf engine and the tiny model: the metrics every step, and
trainer.mismatch() naming each planted cause (a repetition penalty, a skipped weight sync, a bf16 engine) and none
on a clean run; then the checks alone on hand-made re-scorings (temperature, top-p, top-k, a penalty setting)."""

import math

import pytest
import torch

import rlkit
from rlkit.data.batch import Batch
from rlkit.diagnostics import mismatch_report
from rlkit.diagnostics.rescore import PENALTY_GRID, Rescored, nucleus_logits, penalised_logits, seen_tokens
from tests.test_vllm import skip_syncs

CAUSES = {"sampling: temperature", "sampling: top_p/top_k", "sampling: min_new_tokens",
          "sampling: repetition_penalty", "stale weights", "dtype floor", "tokenisation"}  # fmt: skip


def plant_repetition_penalty(penalty: float | None) -> None:
    """On a worker: the hf engine samples (and reports log-probs) under a repetition penalty the trainer does not
    know of, as a model's generation_config would make it (None: remove it)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    model = local_instance(PolicyWorker).engine.model
    if penalty is None:
        vars(model).pop("generate", None)
        return
    generate = type(model).generate

    def penalised(*args, logits_processor=None, **kwargs):
        processors = [RepetitionPenaltyLogitsProcessor(penalty), *(logits_processor or [])]
        return generate(model, *args, logits_processor=processors, **kwargs)

    model.generate = penalised


def engine_in(dtype_name: str) -> None:
    """On a worker: the hf engine's weights in ``dtype_name`` (its fp32 buffers kept), then a sync."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    for param in worker.engine.model.parameters():
        param.data = param.data.to(getattr(torch, dtype_name))
    worker.sync_engine()


@pytest.fixture(scope="module")
def trainer(cluster):
    rollout, optim = rlkit.RolloutConfig(max_new_tokens=8), rlkit.OptimConfig(lr=2e-3)
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=8, group_size=4, optim=optim, rollout=rollout)
    return rlkit.Trainer(cluster, config)


@pytest.mark.timeout(240)
def test_clean_run_measures_every_step_and_names_no_cause(trainer):
    history = trainer.fit(2, progress=False)
    for column in ("mismatch/kl_k3", "mismatch/abs_delta/max", "mismatch/rank1/kl_k3", "mismatch/ratio/min"):
        assert history[column].notna().all(), column
    assert (history["mismatch/abs_delta/mean"] < 1e-4).all() and (history["rollout/logprob_gap/over_limit"] == 0).all()
    position = trainer._prompts.state_dict()
    report = trainer.mismatch()
    assert trainer._prompts.state_dict() == position, "mismatch() must not consume prompts"
    assert report.causes == [] and set(report.checks["check"]) == CAUSES, str(report)
    assert set(report.by_rank["rank"]) == {0, 1} and report.tokens["abs_delta"].max() < 1e-4
    assert {"position", "token_id", "token", "engine_logprob", "trainer_logprob", "ratio", "turn"} <= set(report.tokens)
    floor = trainer.certify()
    assert floor.clean and floor.abs_delta_mean < 1e-4 and floor.tokens > 0, str(floor)


@pytest.mark.timeout(120)
def test_a_repetition_penalty_is_named(trainer):
    trainer.cluster.run(plant_repetition_penalty, 1.3)
    try:
        report = trainer.mismatch()
    finally:
        trainer.cluster.run(plant_repetition_penalty, None)
    assert report.causes == ["sampling: repetition_penalty"], str(report)
    assert "a penalty of 1.3" in report.checks.set_index("check").loc["sampling: repetition_penalty", "evidence"]
    assert report.summary["abs_delta_mean"] > 0.05


@pytest.mark.timeout(120)
def test_a_skipped_sync_is_named(trainer):
    trainer.cluster.run(skip_syncs, True)
    try:
        trainer.step()  # the update's weights never reach the engine
        report = trainer.mismatch()
    finally:
        trainer.cluster.run(skip_syncs, False)
    assert report.causes == ["stale weights"], str(report)
    evidence = report.checks.set_index("check").loc["stale weights", "evidence"]
    assert "0 differ" not in evidence and "the engine holds optimizer step" in evidence
    assert trainer.mismatch().causes == []  # synced again


@pytest.mark.timeout(120)
def test_a_bf16_engine_is_named_as_a_dtype_floor(trainer):
    trainer.cluster.run(engine_in, "bfloat16")
    try:
        report = trainer.mismatch()
        floor = trainer.certify()
    finally:
        trainer.cluster.run(engine_in, "float32")
    assert report.causes == ["dtype floor"], str(report)
    assert report.dtypes == {"trainer": "float32", "engine": "bfloat16"}
    assert floor.causes == ["dtype floor"] and 1e-3 < floor.abs_delta_mean < 3e-2, str(floor)


@pytest.mark.timeout(300)
def test_a_corrected_run_on_a_bf16_engine_still_learns(trainer):
    """Measured (2 CPU workers, 30 steps): the reward's mean over the last 5 steps rose by 0.31 and 0.27 over the
    first 5 (seeds 0 and 1), as the uncorrected fp32 run's 0.30; the weights stayed within [0.91, 1.09]."""
    correction = rlkit.RolloutCorrectionConfig(weight="token", weight_cap=2.0, mask="token", mask_low=0.5,
                                               mask_high=2.0)  # fmt: skip
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=16, group_size=8, kl_coef=0.01,
                              optim=rlkit.OptimConfig(lr=5e-4), rollout=rlkit.RolloutConfig(max_new_tokens=6),
                              rollout_correction=correction)  # fmt: skip
    corrected = rlkit.Trainer(trainer.cluster, config)  # the module's trainer is done with: its engines are replaced
    trainer.cluster.run(engine_in, "bfloat16")
    history = corrected.fit(30, progress=False)
    first, last = history["reward/mean"].head(5).mean(), history["reward/mean"].tail(5).mean()
    assert last > first + 0.2, f"mean reward went {first:.3f} -> {last:.3f}"
    weights = history["rollout_correction/weight/min"].min(), history["rollout_correction/weight/max"].max()
    assert 0.5 < weights[0] < 1 < weights[1] < 2, f"the weights were in {weights}: the correction acted on nothing"


# -- the checks on hand-made re-scorings (no cluster) -----------------------------------------------------------


def toy_case() -> tuple[Batch, torch.Tensor]:
    """One row: a prompt of 2 tokens, a response of 4 (each the most likely token: inside any nucleus), and the
    trainer's logits; the caller sets the engine's log-probs."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 12, generator=gen) * 2
    response = logits.argmax(-1)
    ids = torch.cat([torch.tensor([[int(response[0, 1]), 11]]), response], dim=1)
    batch = Batch(prompts=["p"], completions=["c"], input_ids=ids, attention_mask=torch.ones_like(ids),
                  response_mask=torch.ones(1, 4), rollout_logprobs=torch.zeros(1, 4),
                  group=torch.zeros(1, dtype=torch.long), finish_reason=["length"])  # fmt: skip
    return batch, logits


def picked(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def rescored(batch: Batch, logits: torch.Tensor, temperature: float, top_p: float, sampling=None) -> Rescored:
    tokens = batch.input_ids[:, -4:]
    seen = seen_tokens(batch.input_ids[0], batch.attention_mask[0], 4, 12)
    return Rescored(
        trainer=picked(logits / temperature, tokens),
        no_temperature=picked(logits, tokens) if temperature != 1 else None,
        nucleus=picked(nucleus_logits(logits / temperature, top_p), tokens) if top_p < 1 else None,
        no_early_eos=picked(logits.index_fill(-1, torch.tensor([0]), -torch.inf) / temperature, tokens),
        penalised={p: picked(penalised_logits(logits, seen, p) / temperature, tokens) for p in PENALTY_GRID},
        dtypes={"trainer": "float32", "engine": "float32"},
        sampling={"temperature": temperature, "top_p": top_p, **(sampling or {})},
    )


@pytest.mark.parametrize(
    ("engine", "temperature", "top_p", "named"),
    [
        ("no_temperature", 0.7, 1.0, "sampling: temperature"),
        ("nucleus", 1.0, 0.5, "sampling: top_p/top_k"),
        ("penalised", 1.0, 1.0, "sampling: repetition_penalty"),
        ("no_early_eos", 1.0, 1.0, "sampling: min_new_tokens"),
        ("trainer", 0.7, 0.5, None),
    ],
)
def test_each_hypothesis_names_only_its_cause(engine, temperature, top_p, named):
    batch, logits = toy_case()
    probe = rescored(batch, logits, temperature, top_p)
    batch.rollout_logprobs = probe.penalised[1.5] if engine == "penalised" else getattr(probe, engine)
    report = mismatch_report(batch, [probe])
    assert report.causes == ([named] if named else []), str(report)
    ids = batch.input_ids[0].tolist()
    assert report.tokens["repeated"].tolist() == [ids[2 + t] in ids[: 2 + t] for t in range(4)]
    assert report.tokens["repeated"].any()


def test_engine_settings_name_causes_the_log_probs_cannot_show():
    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 1.0, sampling={"top_k": 20, "repetition_penalty": 1.1, "min_p": 0.0})
    batch.rollout_logprobs = probe.trainer  # sampled under them, log-probs taken before them
    assert mismatch_report(batch, [probe]).causes == ["sampling: top_p/top_k", "sampling: repetition_penalty"]
    assert not math.isnan(mismatch_report(batch, [probe]).summary["kl_k3"])


def test_a_multi_turn_report_groups_by_model_turn_and_names_template_drift():
    from rlkit.data.trajectories import Trajectory

    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 1.0)
    batch.rollout_logprobs = probe.trainer
    batch.response_mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # turn 0, an observation token, turn 1
    batch.turn_index = torch.tensor([[0, 0, 1, 1]])
    batch.trajectories = [Trajectory(messages=[], turns=[], finish_reason="stop")]
    clean = mismatch_report(batch, [probe])
    assert clean.tokens["turn"].tolist() == [0, 1, 1] and clean.by_turn["tokens"].tolist() == [1, 2]
    assert clean.causes == [], str(clean)
    batch.trajectories[0].drift = "turn 1: '<|im_end|>' re-rendered as '\\n'"
    assert mismatch_report(batch, [probe]).causes == ["tokenisation"]
