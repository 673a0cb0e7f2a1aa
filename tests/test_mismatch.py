"""Training-inference mismatch on 2 gloo workers with the hf engine and the tiny model: the metrics every step, and
trainer.mismatch()/certify() naming each planted cause (a repetition penalty, a skipped weight sync, an engine
weight's rows reversed, an unreported top-k in fp32 and bf16, a rank whose engine ignores its loads) and calling
clean runs (fp32 and bf16 engines) clean against the floor measured on the same rows; then the checks alone on
hand-made re-scorings (temperature, top-p, top-k, a penalty setting)."""

import contextlib
import copy
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

import rlkit
from rlkit.data.batch import Batch
from rlkit.diagnostics import mismatch_report
from rlkit.diagnostics.floor import DTYPE_FLOORS
from rlkit.diagnostics.rescore import (
    PENALTY_GRID,
    Rescored,
    effective_temperatures,
    nucleus_logits,
    penalised_logits,
    seen_tokens,
)
from rlkit.rollout.hf import HFEngine
from rlkit.runtime.errors import RolesReplaced
from tests.test_vllm import skip_syncs

CAUSES = {"sampling: temperature", "sampling: top_p/top_k", "sampling: min_new_tokens",
          "sampling: repetition_penalty", "stale weights", "tokenisation"}  # fmt: skip


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


def plant_top_k(k: int | None) -> None:
    """On a worker: the hf engine samples (and reports log-probs) from the top ``k`` tokens only, through a logits
    processor rlkit did not set (None: remove it)."""
    from transformers import TopKLogitsWarper

    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    model = local_instance(PolicyWorker).engine.model
    if k is None:
        vars(model).pop("generate", None)
        return
    generate = type(model).generate

    def truncated(*args, logits_processor=None, **kwargs):
        return generate(model, *args, logits_processor=[TopKLogitsWarper(k), *(logits_processor or [])], **kwargs)

    model.generate = truncated


def plant_temperature(t: float | None) -> None:
    """On a worker: the hf engine samples (and reports log-probs) at temperature ``t`` times the config's, through a
    logits processor rlkit did not set (None: remove it)."""
    from transformers import TemperatureLogitsWarper

    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    engine = local_instance(PolicyWorker).engine
    model = getattr(engine, "inner", engine).model  # an OpaqueEngine's own
    if t is None:
        vars(model).pop("generate", None)
        return
    generate = type(model).generate

    def scaled(*args, logits_processor=None, **kwargs):
        processors = [TemperatureLogitsWarper(t), *(logits_processor or [])]
        return generate(model, *args, logits_processor=processors, **kwargs)

    model.generate = scaled


def reverse_rows(name: str) -> None:
    """On a worker: the rows of the engine's tensor ``name`` in reverse order (its sum and sum of squares kept), as a
    sync that stacks or copies in the wrong order leaves them."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    param = local_instance(PolicyWorker).engine.model.get_parameter(name)
    param.data = param.data.flip(0)


def ignore_loads(rank: int | None) -> None:
    """On a worker: rank ``rank``'s engine takes every weight a sync sends and keeps none, reporting them loaded
    (None: restore every engine and sync)."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    if rank is None:
        vars(worker.engine).pop("load_weights", None)
        worker.sync_engine()
    elif worker.rank == rank:
        worker.engine.load_weights = lambda weights: sum(1 for _ in weights)


def set_engine_generation_config(name: str, value: object) -> None:
    """On a worker: a setting in the hf engine's model.generation_config (what transformers fills unset settings
    from; a model directory's generation_config.json lands there)."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    setattr(local_instance(PolicyWorker).engine.model.generation_config, name, value)


def resync() -> None:
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    local_instance(PolicyWorker).sync_engine()


def engine_in(dtype_name: str) -> None:
    """On a worker: the hf engine's weights in ``dtype_name`` (its fp32 buffers kept), then a sync."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    for param in worker.engine.model.parameters():
        param.data = param.data.to(getattr(torch, dtype_name))
    worker.sync_engine()


class SleepingHFEngine(HFEngine):
    """The hf engine with vLLM's sleep mode on GPU modelled: asleep, its model is a copy on the meta device (any read
    of its weights raises, as reading a sleeping vLLM engine's unmapped weights faults the GPU), the real one kept
    aside until it wakes."""

    def sleep(self) -> None:
        if "_kept" not in vars(self):
            self._kept, self.model = self.model, copy.deepcopy(self.model).to("meta")

    def wake(self) -> None:
        if "_kept" in vars(self):
            self.model = vars(self).pop("_kept")

    def generate(self, *args, **kwargs):
        self.wake()
        return super().generate(*args, **kwargs)

    def load_weights(self, weights):
        self.wake()
        return super().load_weights(weights)

    @contextlib.contextmanager
    def weights_awake(self):
        asleep = "_kept" in vars(self)
        self.wake()
        try:
            yield
        finally:
            if asleep:
                self.sleep()


def engine_sleeps(on: bool) -> bool:
    """On a worker: the hf engine made a SleepingHFEngine, asleep (``on``), or a plain, awake one again; whether it
    was asleep."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    engine = local_instance(PolicyWorker).engine
    asleep = "_kept" in vars(engine)
    if not on and isinstance(engine, SleepingHFEngine):
        engine.wake()
    engine.__class__ = SleepingHFEngine if on else HFEngine
    if on:
        engine.sleep()  # as after a rollout on a GPU
    return asleep


class OpaqueEngine:
    """An hf engine seen as the probe sees vLLM on a GPU: in another process (no model rlkit holds, no weights it can
    read), computing in ``dtype`` with kernels of its own that round differently from the trainer's (modelled: each
    element of the final hidden state moved by ``rounding`` of its size, up or down at random, about one bf16 ulp)."""

    name = "opaque"

    def __init__(self, inner: HFEngine, dtype: torch.dtype, rounding: float):
        self.inner, self.dtype, self.eos_token_id = inner, dtype, inner.eos_token_id
        for param in inner.model.parameters():
            param.data = param.data.to(dtype)
        generator = torch.Generator().manual_seed(0)

        def rounded(module, inputs, hidden):
            signs = torch.randint(0, 2, hidden.shape, generator=generator).to(hidden) * 2 - 1
            return hidden * (1 + rounding * signs)

        inner.model.model.norm.register_forward_hook(rounded)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)

    def effective_sampling(self, params):
        return self.inner.effective_sampling(params)

    def load_weights(self, weights):
        return self.inner.load_weights(weights)

    def weights_awake(self):
        return contextlib.nullcontext()

    def sleep(self):
        pass

    def close(self):
        pass


def engine_out_of_process(dtype_name: str, rounding: float) -> None:
    """On a worker: its hf engine made an OpaqueEngine in ``dtype_name``, then a sync."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    worker.engine = OpaqueEngine(worker.engine, getattr(torch, dtype_name), rounding)
    worker.sync_engine()


@pytest.fixture(scope="module")
def _held_trainer(cluster) -> dict:
    """The module's trainer, kept across its tests (filled by ``trainer``)."""
    return {}


@pytest.fixture
def trainer(_held_trainer, cluster):
    """The module's trainer, or a new one when a test's own Trainer replaced its roles on the cluster (one owner's
    models live on a cluster at a time), so no test depends on running before those."""
    held = _held_trainer.get("trainer")
    try:
        if held is not None:
            held._check_usable()
    except RolesReplaced:
        held = None
    if held is None:
        rollout, optim = rlkit.RolloutConfig(max_new_tokens=8), rlkit.OptimConfig(lr=2e-3)
        config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=8, group_size=4, optim=optim, rollout=rollout)
        held = _held_trainer["trainer"] = rlkit.Trainer(cluster, config)
    return held


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
    assert floor.verdict.startswith("clean") and floor.floor > 0, str(floor)


@pytest.mark.timeout(180)
def test_certify_reads_a_sleeping_engine_s_weights_awake_and_leaves_it_asleep(trainer):
    trainer.cluster.run(engine_sleeps, True)
    try:
        floor = trainer.certify()  # its rollouts wake the engine and put it back to sleep, as on a GPU
        assert trainer.cluster.run(engine_sleeps, True) == [True, True], "certify() must leave the engine asleep"
    finally:
        trainer.cluster.run(engine_sleeps, False)
    assert floor.clean and floor.report.checks.set_index("check").loc["stale weights", "named"] == False, str(floor)  # noqa: E712


@pytest.mark.timeout(120)
def test_an_engine_sampling_at_another_temperature_than_the_config_s_1_is_named(trainer):
    trainer.cluster.run(plant_temperature, 0.8)
    try:
        floor = trainer.certify()
    finally:
        trainer.cluster.run(plant_temperature, None)
    assert not floor.clean and floor.causes == ["sampling: temperature"], str(floor)
    evidence = floor.report.checks.set_index("check").loc["sampling: temperature", "evidence"]
    assert evidence.startswith("the trainer at temperature 0.8 leaves"), evidence


def probe_and_score(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor) -> list[bool]:
    """On a worker: whether the probe's trainer log-probs of this rank's 4 rows are bit for bit the padding-free
    forward's (the update's) and the padded one's."""
    from rlkit.models.logprobs import response_logprobs
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker
    from rlkit.workers.batches import Rows

    worker = local_instance(PolicyWorker)
    mine = slice(4 * worker.rank, 4 * worker.rank + 4)
    rows = Rows(input_ids=input_ids[mine], attention_mask=attention_mask[mine], response_mask=response_mask[mine])
    probed = worker.mismatch_probe(rows).trainer
    width, temperature = response_mask.shape[1], worker.config.rollout.temperature
    with torch.no_grad():
        return [torch.equal(probed, response_logprobs(worker.actor.model, rows.input_ids, rows.attention_mask,
                                                      response_width=width, temperature=temperature,
                                                      padding_free=packed)[0]) for packed in (True, False)]  # fmt: skip


@pytest.mark.timeout(120)
def test_the_probe_scores_through_the_update_s_padding_free_forward(trainer):
    batch = trainer._side_rollout(trainer._next_seeds())  # as mismatch() draws it: the prompt stream stays put
    lengths = batch.attention_mask.sum(1)
    order = lengths.argsort(stable=True)  # each rank's 4 rows hold the shortest or the longest: padding to remove
    rows = torch.cat([order[[0, 2, 4, -1]], order[[1, 3, 5, -2]]])
    assert all(lengths[rows[r * 4 : r * 4 + 4]].unique().numel() > 1 for r in range(2)), lengths
    picked = batch.select(rows)
    same = trainer.cluster.run(probe_and_score, picked.input_ids, picked.attention_mask, picked.response_mask)
    assert same == [[True, False], [True, False]], same


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
def test_a_penalty_from_the_generation_config_the_engine_reads_is_named_from_its_own_settings(trainer):
    trainer.cluster.run(set_engine_generation_config, "repetition_penalty", 1.3)
    try:
        report = trainer.mismatch()
    finally:
        trainer.cluster.run(set_engine_generation_config, "repetition_penalty", None)
    assert report.causes == ["sampling: repetition_penalty"] and not report.clean, str(report)
    assert report.sampling["repetition_penalty"] == 1.3 and report.sampling["top_k"] == 0, report.sampling
    assert "the engine's settings show {'repetition_penalty': 1.3}" in str(report)


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
    assert "fingerprints differ" in evidence and "the engine last confirmed the weights of optimizer step" in evidence
    assert trainer.mismatch().causes == []  # synced again


@pytest.mark.timeout(120)
def test_a_bf16_engine_is_clean_against_its_bf16_floor(trainer):
    trainer.cluster.run(engine_in, "bfloat16")
    try:
        floor = trainer.certify()
    finally:
        trainer.cluster.run(engine_in, "float32")
    assert floor.clean and floor.verdict.startswith("clean"), str(floor)
    assert floor.dtypes == {"trainer": "float32", "engine": "bfloat16"}
    assert 1e-3 < floor.floor < 3e-2 and abs(floor.abs_delta_mean - floor.floor) <= floor.tolerance, str(floor)
    assert "bfloat16 copy of the engine's model" in floor.verdict


@pytest.mark.timeout(120)
def test_an_engine_weight_with_its_rows_reversed_is_named(trainer):
    trainer.cluster.run(reverse_rows, "model.layers.0.mlp.down_proj.weight")  # after the last sync
    try:
        floor = trainer.certify()
    finally:
        trainer.cluster.run(resync)
    assert not floor.clean and floor.causes == ["stale weights"], str(floor)
    evidence = floor.report.checks.set_index("check").loc["stale weights", "evidence"]
    assert "rank 0: 1 of" in evidence and "rank 1: 1 of" in evidence and "mlp.down_proj" in evidence, evidence


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("dtype", "k"), [("float32", 8), ("bfloat16", 8), ("bfloat16", 4)])
def test_an_unreported_top_k_is_named(trainer, dtype, k):
    trainer.cluster.run(engine_in, dtype)
    trainer.cluster.run(plant_top_k, k)
    try:
        floor = trainer.certify(max_rows=128)  # ~400 tokens: a top-k of 8 shifts bf16 log-probs by ~5 standard errors
    finally:
        trainer.cluster.run(plant_top_k, None)
        trainer.cluster.run(engine_in, "float32")
    assert not floor.clean and floor.causes == ["sampling: top_p/top_k"], str(floor)
    assert f"renormalised as top_k={k} " in floor.report.checks.set_index("check").loc["sampling: top_p/top_k",
                                                                                      "evidence"], str(floor)
    assert not floor.report.floor.within, str(floor.report.floor)  # the bias (bf16) or the gap (fp32) beyond it


@pytest.mark.timeout(180)
def test_a_rank_whose_engine_ignores_its_loads_is_named_with_its_figures(trainer):
    trainer.cluster.run(ignore_loads, 1)
    try:
        trainer.step()  # rank 1's engine keeps the weights before this update
        floor = trainer.certify()
    finally:
        trainer.cluster.run(ignore_loads, None)
    assert not floor.clean and floor.causes == ["stale weights"], str(floor)
    evidence = floor.report.checks.set_index("check").loc["stale weights", "evidence"]
    assert evidence.startswith("rank 1: ") and "rank 0" not in evidence, evidence
    by_rank = floor.report.floor.by_rank.set_index("rank")
    assert by_rank.loc[0, "within"] and not by_rank.loc[1, "within"], by_rank
    assert "rank 1: gap" in floor.verdict and "rank 0: gap" not in floor.verdict, floor.verdict


@pytest.mark.timeout(400)
def test_a_bf16_trainer_and_an_out_of_process_bf16_engine_read_clean_and_each_planted_cause_is_named(trainer):
    """vLLM in bf16 on a GPU as the probe sees it: no engine model to copy, the trainer computing in the engine's
    dtype, so the floor's reference repeats the trainer's arithmetic; the floor is then the dtype's least one."""
    config = dataclasses.replace(trainer.config, fsdp=rlkit.FSDPConfig(param_dtype="bf16"))
    bf16 = rlkit.Trainer(trainer.cluster, config)  # the module's trainer's roles are replaced (rebuilt after)
    bf16.cluster.run(engine_out_of_process, "bfloat16", 2**-8)
    bf16.step()
    clean = bf16.certify()
    assert clean.clean and clean.report.floor.minimum == DTYPE_FLOORS["bfloat16"], str(clean)
    assert clean.dtypes == {"trainer": "bfloat16", "engine": "bfloat16"} and clean.abs_delta_mean > 1e-3, str(clean)
    bf16.cluster.run(plant_temperature, 0.8)
    try:
        hot = bf16.certify()
    finally:
        bf16.cluster.run(plant_temperature, None)
    assert hot.causes == ["sampling: temperature"], str(hot)
    bf16.cluster.run(skip_syncs, True)
    try:
        bf16.step()
        stale = bf16.certify()
    finally:
        bf16.cluster.run(skip_syncs, False)
    assert stale.causes == ["stale weights"], str(stale)


def test_a_floor_that_repeats_the_trainer_s_arithmetic_is_held_at_the_dtype_s_least():
    """A reference equal to the trainer (a floor of 0) in bf16, an engine off by bf16-sized rounding both ways:
    clean against the dtype's least floor; an engine at another temperature is still named."""
    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 1.0)
    probe.reference, probe.floor_minimum = probe.trainer, DTYPE_FLOORS["bfloat16"]
    batch.rollout_logprobs = probe.trainer + torch.tensor([[6e-3, -6e-3, 6e-3, -6e-3]])
    report = mismatch_report(batch, [probe])
    assert report.clean and report.floor.floor == DTYPE_FLOORS["bfloat16"], str(report)
    batch.rollout_logprobs = probe.temperatures[0.8]
    assert mismatch_report(batch, [probe]).causes == ["sampling: temperature"]


@pytest.mark.timeout(300)
def test_a_corrected_run_on_a_bf16_engine_still_learns(trainer):
    """Measured (2 CPU workers, 30 steps): the reward's mean over the last 5 steps rose by 0.31 and 0.27 over the
    first 5 (seeds 0 and 1), as the uncorrected fp32 run's 0.30; the weights stayed within [0.91, 1.09]."""
    correction = rlkit.RolloutCorrectionConfig(weight="token", weight_cap=2.0, mask="token", mask_low=0.5,
                                               mask_high=2.0)  # fmt: skip
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=16, group_size=8, kl_coef=0.01,
                              optim=rlkit.OptimConfig(lr=5e-4), rollout=rlkit.RolloutConfig(max_new_tokens=6),
                              rollout_correction=correction)  # fmt: skip
    corrected = rlkit.Trainer(trainer.cluster, config)  # the module's trainer's roles are replaced (rebuilt after)
    corrected.cluster.run(engine_in, "bfloat16")
    try:
        history = corrected.fit(30, progress=False)
    finally:
        corrected.cluster.run(engine_in, "float32")
    first, last = history["reward/mean"].head(5).mean(), history["reward/mean"].tail(5).mean()
    assert last > first + 0.2, f"mean reward went {first:.3f} -> {last:.3f}"
    weights = history["rollout_correction/weight/min"].min(), history["rollout_correction/weight/max"].max()
    assert 0.5 < weights[0] < 1 < weights[1] < 2, f"the weights were in {weights}: the correction acted on nothing"


@pytest.mark.timeout(240)
def test_bypass_skips_the_old_logprob_forward_with_several_optimizer_steps(trainer):
    """verl's bypass: the engine is the old policy, so recompute_logprobs=False is allowed with 2 epochs x 2
    mini-batches; the mask then tests the current policy against the engine (a band that excludes nothing keeps
    every token), and the first epoch's forwards fill batch.logprobs, each row at its place."""
    correction = rlkit.RolloutCorrectionConfig.preset("verl_bypass", mask="token", mask_low=0.5, mask_high=2.0)
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=4, group_size=4, mini_batches=2, ppo_epochs=2,
                              recompute_logprobs=False, rollout=rlkit.RolloutConfig(max_new_tokens=6),
                              rollout_correction=correction)  # fmt: skip
    bypass = rlkit.Trainer(trainer.cluster, config)  # the module's trainer's roles are replaced (rebuilt after)
    batch = bypass.advantages(bypass.score(bypass.rollout()))
    assert batch.old_logprobs is None
    stats = bypass.update(batch)
    assert stats["rollout_correction/masked_frac"] == 0, stats
    gap = torch.where(batch.response_mask > 0, batch.old_logprobs - batch.rollout_logprobs, 0.0).abs()
    per_rank = len(batch) // 2  # each rank's first mini-batch is scored before any step, the second after one
    first = torch.cat([gap[r * per_rank : r * per_rank + per_rank // 2] for r in range(2)])
    assert first.max() < 1e-4 and gap.max() < 0.05, "the first epoch's log-probs landed on other rows than their own"


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
        temperatures={t: picked(logits / t, tokens) for t in effective_temperatures(temperature)},
        temperature=temperature,
        nucleus=picked(nucleus_logits(logits / temperature, top_p), tokens) if top_p < 1 else None,
        no_early_eos=picked(logits.index_fill(-1, torch.tensor([0]), -torch.inf) / temperature, tokens),
        penalised={p: picked(penalised_logits(logits, seen, p) / temperature, tokens) for p in PENALTY_GRID},
        dtypes={"trainer": "float32", "engine": "float32"},
        sampling={"temperature": temperature, "top_p": top_p, **(sampling or {})},
    )


@pytest.mark.parametrize(
    ("engine", "temperature", "top_p", "named"),
    [
        ("temperature=1.0", 0.7, 1.0, "sampling: temperature"),
        ("temperature=0.8", 1.0, 1.0, "sampling: temperature"),
        ("temperature=0.49", 0.7, 1.0, "sampling: temperature"),
        ("nucleus", 1.0, 0.5, "sampling: top_p/top_k"),
        ("penalised", 1.0, 1.0, "sampling: repetition_penalty"),
        ("no_early_eos", 1.0, 1.0, "sampling: min_new_tokens"),
        ("trainer", 0.7, 0.5, None),
    ],
)
def test_each_hypothesis_names_only_its_cause(engine, temperature, top_p, named):
    batch, logits = toy_case()
    probe = rescored(batch, logits, temperature, top_p)
    if engine.startswith("temperature="):
        batch.rollout_logprobs = probe.temperatures[float(engine.split("=")[1])]
    else:
        batch.rollout_logprobs = probe.penalised[1.5] if engine == "penalised" else getattr(probe, engine)
    report = mismatch_report(batch, [probe])
    assert report.causes == ([named] if named else []), str(report)
    ids = batch.input_ids[0].tolist()
    assert report.tokens["repeated"].tolist() == [ids[2 + t] in ids[: 2 + t] for t in range(4)]
    assert report.tokens["repeated"].any()


def test_a_temperature_the_engine_reports_is_checked_against_the_config_s_1():
    """The engine says 0.8, the config 1, and its log-probs are the trainer's (taken before its temperature)."""
    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 1.0, sampling={"temperature": 0.8})
    batch.rollout_logprobs = probe.trainer
    report = mismatch_report(batch, [probe])
    assert report.causes == ["sampling: temperature"], str(report)
    assert "temperature 0.8 and the trainer scores at rollout.temperature=1" in report.checks.loc[0, "fix"]


def test_the_fix_offers_the_correction_only_when_it_is_off():
    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 0.5)
    batch.rollout_logprobs = probe.nucleus
    fixes = {on: mismatch_report(batch, [probe], correction_on=on).checks.set_index("check").loc[
        "sampling: top_p/top_k", "fix"] for on in (False, True)}  # fmt: skip
    assert fixes[False].endswith("or turn rollout_correction on"), fixes[False]
    assert "turn rollout_correction on" not in fixes[True] and "rollout_correction is already on" in fixes[True]


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


def test_a_gap_no_check_explains_is_unexplained_with_its_factor_and_the_rank():
    """Two ranks' rows against a reference 1e-3 from the trainer: rank 1's engine is off by a further 0.05 nats one
    way on every token, which no hypothesis reproduces."""
    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 1.0)
    noise = torch.tensor([[1e-3, -1e-3, 1e-3, -1e-3]])
    probe.reference, probe.reference_kind = probe.trainer + noise, "a hand-made reference"
    other = dataclasses.replace(probe, rank=1)
    two = Batch.concat([batch, batch])
    two.rollout_logprobs = torch.cat([probe.reference, other.reference + 0.05])
    report = mismatch_report(two, [probe, other])
    assert report.causes == [] and not report.clean, str(report)
    assert report.verdict.startswith("unexplained: 25.5 x the floor"), report.verdict  # 0.0255 on a floor of 1e-3
    assert "ruled out: sampling: temperature, sampling: top_p/top_k" in report.verdict
    assert "tokenisation" not in report.verdict, "single-turn rollouts: the tokenisation check did not run"
    assert report.checks.set_index("check")["ran"].to_dict()["tokenisation"] == False  # noqa: E712
    assert "rank 1: gap 0.05 = 50x its floor 0.001" in report.verdict and "rank 0: gap" not in report.verdict
    by_rank = report.floor.by_rank.set_index("rank")
    assert by_rank.loc[0, "within"] and by_rank.loc[0, "bias"] == pytest.approx(0, abs=1e-7)
    assert by_rank.loc[1, "bias"] == pytest.approx(-0.05, abs=1e-6)


def test_floor_figures_by_hand():
    """Row sums over checked tokens; the excess's tolerance from the floor's spread, the bias's from its own."""
    from rlkit.diagnostics.floor import FLOAT_NOISE, measure_floor

    trainer = torch.zeros(2, 2)
    reference = torch.tensor([[0.1, 0.1], [0.3, 0.0]])  # floor rows: sums 0.2 and 0.3 over 2 and 1 tokens
    engine = torch.tensor([[0.2, 0.0], [0.3, 9.0]])
    checked = torch.tensor([[True, True], [True, False]])
    floor = measure_floor(trainer, engine, reference, checked, torch.tensor([0, 0]), "by hand")
    assert (floor.tokens, floor.gap, floor.floor) == (3, pytest.approx(0.5 / 3), pytest.approx(0.5 / 3))
    assert floor.bias == pytest.approx(0.0)  # (0.1 - 0.2) + (0.1 - 0) + (0.3 - 0.3)
    # the floor's residuals per row: 0.2 - (0.5/3)*2 and 0.3 - 0.5/3; ratio estimator's SE with 2 rows
    residuals = torch.tensor([0.2 - 1 / 3, 0.3 - 0.5 / 3], dtype=torch.float64)
    se = math.sqrt(float(residuals.square().sum()) * 2) / 3
    assert floor.tolerance == pytest.approx(3 * math.sqrt(2) * se + FLOAT_NOISE)
    assert floor.within and floor.factor == pytest.approx(1.0)


def test_fingerprints_see_order_and_not_summation_noise():
    from rlkit.models.fingerprint import TOLERANCE, differs, fingerprint

    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    same = fingerprint(weight)
    assert differs(same, fingerprint(weight.clone())) == 0.0
    assert differs(same, fingerprint(weight.double().float())) < TOLERANCE
    for moved in (weight.flip(0), weight.roll(1, dims=1), torch.cat([weight[32:], weight[:32]])):
        assert moved.sum() == pytest.approx(float(weight.sum()), abs=1e-3) and differs(same, fingerprint(moved)) > 0.01
    assert differs(same, fingerprint(weight.to(torch.bfloat16))) > TOLERANCE  # a cast the trainer did not make
    assert differs(fingerprint(weight.to(torch.bfloat16)), fingerprint(weight.to(torch.bfloat16).clone())) == 0.0


# -- what the reports print and the guide says -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
MARKUP = re.compile(r"``|:(?:class|func|meth|attr|data|mod|doc):`|\*\*\w[^*]*\*\*|^#+ ", re.MULTILINE)
"""reStructuredText literals and roles, Markdown bold and headings: markup a cell or a terminal prints as it is."""


def test_the_printed_mismatch_and_certify_reports_are_plain_text():
    """``print(trainer.mismatch())`` and ``print(trainer.certify())`` (its report) show ``|delta|``, not RST."""
    from rlkit.trainer.mismatch import gap_floor

    batch, logits = toy_case()
    probe = rescored(batch, logits, 1.0, 0.5)
    batch.rollout_logprobs = probe.nucleus
    report = mismatch_report(batch, [probe])
    certified = gap_floor(report, rlkit.RolloutConfig(top_p=0.5))
    for text in (str(report), str(certified), str(certified.report)):
        assert "mean |delta| " in text and not MARKUP.search(text), text


def test_no_message_rlkit_makes_carries_restructuredtext_markup():
    """Every string literal of rlkit that is not a docstring (messages, reports, verdicts) is plain text (a Markdown
    code fence for TensorBoard's text tab, which renders it, is not a literal)."""
    import ast

    found = []
    for path in sorted((ROOT / "rlkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if re.search(r"(?<!`)``(?!`)|:(?:class|func|meth|attr|data|mod):`", node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "\n".join(found)


def test_the_guide_states_the_tolerance_the_floor_uses():
    """docs/guides/mismatch.md's clean verdict: both tolerances add FLOAT_NOISE nats (it said 1e-6; the code 1e-4)."""
    from rlkit.diagnostics.floor import FLOAT_NOISE

    guide = (ROOT / "docs" / "guides" / "mismatch.md").read_text()
    verdict = guide[guide.index('The verdict is "clean"'):guide.index("Otherwise")]
    stated = re.findall(r"plus\s+(\d(?:\.\d+)?e-\d+)", verdict)
    assert len(stated) == 2 and all(float(value) == FLOAT_NOISE for value in stated), stated
