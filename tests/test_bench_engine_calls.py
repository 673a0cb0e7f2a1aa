"""bench/engine_calls.py and bare_vllm.py take rlkit's generation apart: each cause of its difference from bare vLLM
is one paired ratio, and every engine setting and sampling field that differs between the two engines is listed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bare_vllm  # noqa: E402
import engine_calls  # noqa: E402
from bare_vllm import BareVLLM, engine_settings, mixed_params, sampling_fields  # noqa: E402
from engine_calls import CAUSES, VARIANTS, Probe, _start_processed, causes, differences  # noqa: E402


def test_each_cause_is_the_paired_ratio_of_two_variants_that_differ_by_it_alone():
    seconds = {"rlkit": [3.3, 3.6, 3.0], "engine_mixed": [3.0, 3.0, 3.0], "bare_plain": [2.0, 3.0, 2.5],
               "bare_mixed": [2.2, 3.3, 2.5]}
    out = causes(seconds)
    wrapping = out["rlkit's wrapping"]  # per round 1.1, 1.2, 1.0; medians 3.3 / 3.0
    assert wrapping["ratio_of_medians"] == pytest.approx(1.1)
    assert (wrapping["pairs_min"], wrapping["pairs_median"], wrapping["pairs_max"]) == pytest.approx((1.0, 1.1, 1.2))
    assert out["log-prob rows, bare vLLM"]["ratio_of_medians"] == pytest.approx(2.5 / 2.5)
    assert out["rlkit over bare vLLM"]["ratio_of_medians"] == pytest.approx(3.3 / 2.5)
    same_rows = out["rlkit over bare vLLM asked for the same rows"]  # per round 1.5, 1.0909, 1.2
    assert (same_rows["pairs_min"], same_rows["pairs_median"]) == pytest.approx((3.6 / 3.3, 1.2))
    # causes whose variants did not run (no engine_plain, no processed engine) are left out, not zero or NaN
    assert set(out) == {"rlkit's wrapping", "log-prob rows, bare vLLM", "rlkit over bare vLLM",
                        "rlkit over bare vLLM asked for the same rows"}


def test_every_cause_names_two_variants_the_breakdown_runs_and_every_variant_is_in_a_cause():
    named = {v for pair in CAUSES.values() for v in pair}
    assert named == set(VARIANTS) and all(a != b for a, b in CAUSES.values())
    # the log-prob mode, the rows and the engine's other settings are each isolated on both sides of the mode
    assert CAUSES["processed_logprobs, no rows"] == ("processed_plain", "bare_plain")
    assert CAUSES["rlkit's other engine settings, with the rows"] == ("engine_mixed", "processed_mixed")


def test_one_groups_fraction_asks_log_probs_of_the_first_prompt_only():
    params = mixed_params(64, 8, 16, 1 / 64)
    assert [p.logprobs for p in params] == [0] + [None] * 63 and all(p.n == 8 and p.min_tokens == 16 for p in params)
    assert sum(p.logprobs == 0 for p in mixed_params(64, 8, 16, 0.125)) == 8


def test_engine_settings_read_every_argument_rlkit_passes_and_skip_what_this_vllm_lacks():
    config = SimpleNamespace(
        model_config=SimpleNamespace(seed=0, logprobs_mode="processed_logprobs", generation_config="vllm",
                                     enforce_eager=False, dtype="bfloat16", max_model_len=320),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.5, kv_cache_memory_bytes=None, block_size=16),
        compilation_config=SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE", max_cudagraph_capture_size=512),
        parallel_config=SimpleNamespace(worker_extension_cls="rlkit.rollout.vllm_worker.WorkerExtension"),
    )
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    out = engine_settings(llm)
    assert out["model_config.seed"] == "0" and out["model_config.logprobs_mode"] == "processed_logprobs"
    assert out["parallel_config.worker_extension_cls"] == "rlkit.rollout.vllm_worker.WorkerExtension"
    assert out["compilation_config.max_cudagraph_capture_size"] == "512"
    assert out["cache_config.kv_cache_memory_bytes"] == "None" and out["cache_config.block_size"] == "16"
    assert "scheduler_config.max_num_seqs" not in out  # no scheduler_config here: skipped, not an error


def test_differences_keep_only_what_differs_including_a_key_one_side_lacks():
    mine = {"model_config.logprobs_mode": "processed_logprobs", "model_config.seed": "0",
            "sampling.stop_token_ids": "[0]"}
    bare = {"model_config.logprobs_mode": "raw_logprobs", "model_config.seed": "0", "sampling.stop_token_ids": "[]",
            "cache_config.block_size": "16"}
    assert differences(mine, bare) == {
        "cache_config.block_size": {"rlkit": None, "bare": "16"},
        "model_config.logprobs_mode": {"rlkit": "processed_logprobs", "bare": "raw_logprobs"},
        "sampling.stop_token_ids": {"rlkit": "[0]", "bare": "[]"},
    }


def test_sampling_fields_list_a_vllm_sampling_params_fields_and_a_plain_objects_attributes():
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    fields = sampling_fields(SamplingParams(n=8, temperature=1.0, max_tokens=16, min_tokens=16, detokenize=False,
                                            logprobs=0, flat_logprobs=True))
    assert (fields["n"], fields["max_tokens"], fields["logprobs"], fields["detokenize"]) == ("8", "16", "0", "False")
    assert fields["seed"] == "None"  # no per-request seed: vLLM samples the whole batch at once
    assert sampling_fields(SimpleNamespace(seed=3, _private=1)) == {"seed": "3"}


class _FakeLLM:
    made: list[dict] = []
    warmups: list[list] = []

    def __init__(self, **kwargs):
        _FakeLLM.made.append(kwargs)

    def generate(self, prompts, params, use_tqdm=False):
        _FakeLLM.warmups.append(params)
        return []


def test_the_bare_engine_takes_vllms_log_prob_mode_unless_told_rlkits(monkeypatch):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "LLM", _FakeLLM)
    _FakeLLM.made.clear()
    _FakeLLM.warmups.clear()
    BareVLLM(Path("/nowhere"), [[1, 2, 3]], group=2, response_len=4)
    BareVLLM(Path("/nowhere"), [[1, 2, 3]], group=2, response_len=4, logprobs_mode="processed_logprobs")
    assert "logprobs_mode" not in _FakeLLM.made[0]
    # the warm-up asks one prompt's log-probs (vLLM compiles their kernel at the first such call, not timed then)
    assert [p.logprobs for p in _FakeLLM.warmups[0]] == [0, None]
    assert _FakeLLM.made[1]["logprobs_mode"] == "processed_logprobs"
    assert {k: v for k, v in _FakeLLM.made[1].items() if k != "logprobs_mode"} == _FakeLLM.made[0]


def test_a_processed_engine_that_does_not_start_is_recorded_and_tried_once():
    tries = []

    def make_bare(**extra):
        tries.append(extra)
        raise ValueError("Free memory on device (9.1/79.2 GiB) is less than desired GPU memory utilization")

    probe = Probe(bare=None, prompt_ids=None, group=8, response_len=16, logprob_fraction=0.125,  # type: ignore[arg-type]
                  make_bare=make_bare)
    _start_processed(probe)
    _start_processed(probe)
    assert tries == [{"logprobs_mode": "processed_logprobs"}] and probe.processed is None
    assert len(probe.problems) == 1
    assert "processed_* not run" in probe.problems[0] and "Free memory" in probe.problems[0]


def test_bare_vllm_module_names_the_fields_it_compares():
    names = {f"{part}.{name}" for part, fields in bare_vllm.ENGINE_FIELDS.items() for name in fields}
    assert {"model_config.logprobs_mode", "model_config.seed", "cache_config.num_gpu_blocks",
            "scheduler_config.max_num_batched_tokens", "compilation_config.cudagraph_capture_sizes"} <= names
    assert engine_calls.VARIANTS[0] == "rlkit"
