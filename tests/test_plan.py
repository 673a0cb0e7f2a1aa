"""The memory plan (rlkit.diagnostics.plan): vLLM's KV cache sized to the rollout, whether the engine stays awake,
the settings chosen when a run does not fit, and a user's settings kept. Model shapes from configs: no weights."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import rlkit
from rlkit import diagnostics as dx
from rlkit.diagnostics.estimate import model_shape
from rlkit.diagnostics.plan import KV_HEADROOM, plan_run, rollout_kv_gib
from rlkit.rollout.sleep import AWAKE_HEADROOM, SleepPolicy

GIB = 2**30
H100 = 79.2
QWEN = dict(model_type="qwen2", vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True)
QWEN_05B = {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14}
QWEN_15B = {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12}
QWEN_3B = {**QWEN, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16}


def yardstick(**changes) -> rlkit.GRPOConfig:
    """GPU.md's workload: 64 prompts x 8 completions of 256 tokens after 64-token prompts, on vLLM."""
    base = dict(model="tiny", prompts_per_step=64, group_size=8, micro_batch_size=64,
                rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=256, min_new_tokens=256),
                data={"max_prompt_tokens": 64})  # fmt: skip
    return rlkit.GRPOConfig(**{**base, **changes})


def plan(config, shape=QWEN_05B, gib=H100, **sizes):
    return plan_run(config, shape, world_size=sizes.pop("world_size", 1), device="cuda", device_memory_gib=gib,
                    **sizes)  # fmt: skip


def chosen(p) -> dict:
    return {c.setting: c.value for c in p.choices}


def test_the_kv_cache_holds_every_completion_of_a_rank_at_its_longest_plus_headroom():
    # 0.5B: 2 (k, v) x 24 layers x 2 kv heads x 64 dims x 2 bytes = 12,288 bytes a token; 512 rows x 320 tokens
    assert rollout_kv_gib(yardstick(), model_shape(QWEN_05B), 1) == pytest.approx(
        (1 + KV_HEADROOM) * 512 * 320 * 12288 / GIB)
    # 2 ranks: each engine serves 256 rows; a 70-token prompt + 256 = 326 tokens take 21 blocks of 16 (336)
    cfg = yardstick(data={"max_prompt_tokens": 70})
    assert rollout_kv_gib(cfg, model_shape(QWEN_05B), 2) == pytest.approx(1.25 * 256 * 336 * 12288 / GIB)
    # tensor parallel 2 over 2 ranks: one engine for both ranks' 512 rows, its heads split over 2 devices
    tp = yardstick(rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=256, tensor_parallel_size=2))
    assert rollout_kv_gib(tp, model_shape(QWEN_05B), 2) == pytest.approx(1.25 * 512 * 320 * 12288 / 2 / GIB)


def test_an_unset_engine_memory_is_sized_to_the_rollout_and_the_engine_told_a_share_that_holds_it():
    p = plan(yardstick())
    kv, share = chosen(p)["rollout.kv_cache_gb"], chosen(p)["rollout.gpu_memory_utilization"]
    assert kv == 2.35  # 2.34375 GiB rounded up to the hundredth
    weights = model_shape(QWEN_05B).num_parameters * 2 / GIB
    assert share * H100 >= weights + kv + 2.0 and share < 0.15  # the old default took 0.5 of the device
    assert p.config.rollout.kv_cache_gb == kv and p.config.rollout.gpu_memory_utilization == share
    assert p.estimate.phases["rollout"]["engine"] == pytest.approx(weights + kv + 2.0)


def test_the_engine_stays_awake_where_both_fit_and_sleeps_where_not_and_the_plan_says_why():
    small, large = plan(yardstick()), plan(yardstick(), QWEN_15B)
    assert small.estimate.engine_awake and "vLLM stays awake through the update" in small.line
    assert small.estimate.engine_line in str(small.estimate)  # trainer.estimate() says it too
    assert not large.estimate.engine_awake
    assert "vLLM sleeps through the update (awake, the peak would be" in large.line
    room = (1 - AWAKE_HEADROOM) * H100
    awake = dx.estimate_memory(model_shape(QWEN_15B), dataclasses.replace(large.estimate.setting,
                                                                               engine_sleep="never"))
    assert awake.peak_gib > room >= small.estimate.peak_gib
    # the same choice with the old fixed share: asleep at 0.5B (the H100 lease's 0.24 s syncs)
    fixed = plan(yardstick(rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=256, gpu_memory_utilization=0.5)))
    assert not fixed.estimate.engine_awake and "rollout.kv_cache_gb" not in chosen(fixed)


def test_the_estimate_keeps_auto_awake_from_the_first_update_then_the_measurement_decides(caplog):
    total, need = 80 * GIB, 30 * GIB
    policy = SleepPolicy("auto")
    policy.expect(need)  # the estimate: the trainer's process will hold 30 GiB at its update's peak
    with caplog.at_level(logging.INFO, logger="rlkit.rollout.sleep"):
        assert not policy.should_sleep(free=60 * GIB, held=5 * GIB, total=total)  # 60 - 25 = 35 >= 8 spare
    assert any("stays awake" in r.getMessage() for r in caplog.records)
    policy.record_update(50 * GIB)  # measured: more than estimated, and it replaces the estimate
    assert policy.need == 50 * GIB and policy.should_sleep(free=40 * GIB, held=5 * GIB, total=total)
    policy.expect(10 * GIB)  # an estimate never replaces a measurement
    assert policy.need == 50 * GIB
    lower = SleepPolicy("auto")
    lower.expect(need)
    lower.record_update(20 * GIB)  # a smaller measured update than estimated: the measurement counts
    assert lower.need == 20 * GIB


def test_a_run_that_does_not_fit_gets_the_cheapest_plan_that_does_in_the_issues_order():
    # 3B on an H100, packed: the largest token budget that fits comes before activation checkpointing
    packed = plan(yardstick(), QWEN_3B)
    budget = chosen(packed)["max_tokens_per_micro_batch"]
    assert 320 <= budget < 64 * 320 and "fsdp.activation_checkpointing" not in chosen(packed)
    assert packed.config.fsdp.activation_checkpointing is False and packed.config.fsdp.cpu_offload is False
    one_more = dataclasses.replace(packed.config, max_tokens_per_micro_batch=budget + 1)
    est = dx.estimate_for(one_more, QWEN_3B, world_size=1, device_memory_gib=H100)
    assert est.tight or not est.fits, "the budget is the largest that fits"
    # padded rows: no budget to set, so checkpointing
    padded = plan(yardstick(padding_free=False), QWEN_3B)
    assert chosen(padded)["fsdp.activation_checkpointing"] is True
    assert "max_tokens_per_micro_batch" not in chosen(padded)
    assert padded.estimate.fits and not padded.estimate.tight


def test_a_setting_the_user_gave_is_never_changed():
    given = yardstick(padding_free=False, fsdp=rlkit.FSDPConfig(compile=False, activation_checkpointing=False),
                      rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=256, gpu_memory_utilization=0.3))
    p = plan(given, QWEN_15B, host_memory_gib=512)
    assert p.config.fsdp.compile is False and p.config.fsdp.activation_checkpointing is False
    assert p.config.rollout.gpu_memory_utilization == 0.3 and p.config.rollout.kv_cache_gb == 0
    assert chosen(p) == {"fsdp.cpu_offload": True}  # the one memory setting left unset, the last resort
    with pytest.raises(rlkit.ConfigError, match="fixes: turn on fsdp.activation_checkpointing"):
        plan(given, QWEN_3B, host_memory_gib=512)  # offload is not enough: refused, the user's "off" kept
    kept = yardstick(max_tokens_per_micro_batch=4096, fsdp=rlkit.FSDPConfig(compile=True))
    assert plan(kept).config.max_tokens_per_micro_batch == 4096 and "fsdp.compile" not in chosen(plan(kept))


def test_a_run_no_plan_fits_is_refused_before_launch_with_the_reason():
    with pytest.raises(rlkit.ConfigError) as err:
        plan(yardstick(fsdp=rlkit.FSDPConfig(cpu_offload=False)), QWEN_3B, gib=20.0)
    (problem,) = err.value.problems
    assert problem.startswith("this run does not fit however its unset memory settings are planned")
    assert "peak 70.1 GiB in 'rollout' against the device's 20.0 GiB" in problem and "more ranks" in problem, problem
    with pytest.raises(rlkit.ConfigError, match="the host would hold"):  # offload needs more host than there is
        plan(yardstick(), QWEN_3B, gib=20.0, host_memory_gib=32)


def test_on_cpu_nothing_is_sized_and_the_unset_switches_are_off():
    p = plan_run(yardstick(), world_size=2, device="cpu")
    assert p.estimate is None and chosen(p) == {"fsdp.compile": False}
    fsdp = p.config.fsdp
    assert (fsdp.compile, fsdp.activation_checkpointing, fsdp.cpu_offload) == (False, False, False)
    assert p.config.rollout.gpu_memory_utilization is None and "CPU cluster, nothing sized" in p.line


@pytest.mark.parametrize("changes, why", [({"fsdp": rlkit.FSDPConfig(version=1)}, "FSDP1"),
                                         ({"lora": rlkit.LoraConfig(rank=16)}, "LoRA")])
def test_fsdp1_and_lora_are_not_compiled_and_the_plan_says_why(changes, why):
    p = plan(yardstick(**changes))
    (choice,) = [c for c in p.choices if c.setting == "fsdp.compile"]
    assert choice.value is False and why in choice.reason and p.config.fsdp.compile is False
