"""fsdp.kernels="liger": refused before launch wherever it cannot run (the kernels themselves run in test_gpu)."""

from __future__ import annotations

import importlib.util

import pytest
from family_models import build_family_model

import rlkit
from rlkit.models.families import model_family_problems
from rlkit.models.kernels import apply_kernels


def liger_config(model: str = "tiny") -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(model=model, fsdp=rlkit.FSDPConfig(kernels="liger"))


def test_liger_on_a_cpu_cluster_is_refused_with_the_fix():
    problems = liger_config().cluster_problems(2, "cpu")
    assert problems == ['fsdp.kernels="liger" on a CPU cluster: Liger\'s kernels are Triton GPU kernels; use "torch"']


def test_liger_on_gpus_without_the_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    problems = liger_config().cluster_problems(2, "cuda")
    assert len(problems) == 1 and "pip install 'rlkit[kernels]'" in problems[0]


def test_an_unknown_kernels_value_lists_the_choices():
    with pytest.raises(rlkit.ConfigError, match=r"fsdp.kernels=\"triton\": use one of \('torch', 'liger'\)"):
        rlkit.GRPOConfig.from_dict({"model": "tiny", "fsdp": {"kernels": "triton"}})


@pytest.mark.parametrize("family, refused", [("qwen2", False), ("qwen3", False), ("llama3", False),
                                              ("mistral", False), ("gemma2", True), ("phi3", True)])
def test_liger_is_refused_before_launch_for_a_family_it_is_not_swapped_into(tmp_path, family, refused):
    model_dir = build_family_model(family, tmp_path / family, tied=False)
    problems = model_family_problems(liger_config(str(model_dir)), "cuda")
    assert any('fsdp.kernels="liger"' in p for p in problems) == refused
    assert model_family_problems(rlkit.GRPOConfig(model=str(model_dir)), "cuda") == []


def test_a_worker_refuses_liger_for_a_family_it_is_not_swapped_into(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_family_model("phi3", tmp_path / "phi3", tied=False))
    with pytest.raises(ValueError, match=r'fsdp.kernels="liger" with a phi3 model: .* use fsdp.kernels="torch"'):
        apply_kernels(model, "liger")
