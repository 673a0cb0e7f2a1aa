"""Checkpoints: exact resume across a relaunch, atomic saves, keep-last-K, a Hugging Face export."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import rlkit
from rlkit.trainer import checkpoints

CONFIG = dict(
    model="tiny", seed=3, prompts_per_step=4, group_size=4, kl_coef=0.01,
    rollout=rlkit.RolloutConfig(max_new_tokens=6), optim=rlkit.OptimConfig(lr=5e-4, warmup_steps=2),
)


def actor_weights() -> dict[str, torch.Tensor]:
    """On a worker: the actor's full weights (a collective)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    return dict(iter_full_params(local_instance(PolicyWorker).actor.model))


@pytest.mark.timeout(300)
def test_hf_export_loads_without_rlkit_and_keep_last(cluster, tmp_path):
    config = rlkit.GRPOConfig(**CONFIG, checkpoint=rlkit.CheckpointConfig(keep_last=2))
    trainer = rlkit.Trainer(cluster, config)
    for _ in range(3):
        trainer.step()
        last = trainer.save(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    def logits(ids):
        from rlkit.runtime import local_instance
        from rlkit.workers import PolicyWorker

        model = local_instance(PolicyWorker).actor.model
        with torch.no_grad():
            return model(input_ids=ids).logits

    expected = cluster.run(logits, ids)[0]
    assert [p.name for p in checkpoints.complete(tmp_path)] == ["step-000002", "step-000003"]

    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        assert "rlkit" not in sys.modules
        model = AutoModelForCausalLM.from_pretrained({str(last / "hf")!r}, dtype=torch.float32)
        AutoTokenizer.from_pretrained({str(last / "hf")!r})
        torch.save(model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits.detach(), {str(tmp_path / "logits.pt")!r})
        assert "rlkit" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120)
    got = torch.load(tmp_path / "logits.pt", weights_only=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_resume_is_exact(cluster, tmp_path):
    """The straight run and the saved one on the session's cluster (each a fresh Trainer), the resume on a fresh
    launch (which replaces that cluster: this test comes last of the module's users of it)."""
    straight = rlkit.Trainer(cluster, rlkit.GRPOConfig(**CONFIG))
    straight.fit(4, progress=False)
    expected = cluster.run(actor_weights)[0]
    expected_history = straight.history

    first = rlkit.Trainer(cluster, rlkit.GRPOConfig(**CONFIG))
    first.fit(2, progress=False)
    saved = first.save(tmp_path / "ckpt")
    assert saved.name == "step-000002"

    with rlkit.launch(world_size=2) as fresh:
        resumed = rlkit.Trainer.resume(fresh, tmp_path / "ckpt")
        assert resumed.steps_done == 2
        resumed.fit(2, progress=False)
        got = fresh.run(actor_weights)[0]
        history = resumed.history

    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs after resume"
    assert history["reward/mean"].tolist() == expected_history["reward/mean"].tolist()
    assert history["actor/lr"].tolist() == expected_history["actor/lr"].tolist()


SAVER = """
import sys, time, rlkit
from rlkit.trainer import checkpoints
root = sys.argv[1]
with rlkit.launch(world_size=2) as cluster:
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(model="tiny", prompts_per_step=4, group_size=4))
    trainer.step()
    trainer.save(root)
    trainer.step()
    trainer.save(root)
    print("second save finished: the test was too slow to kill it", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_kill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob(".step-000002.partial-*")):
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(root.glob(".step-000002.partial-*")), "the interrupted save left no partial folder"
    assert [p.name for p in checkpoints.complete(root)] == ["step-000001"]
    assert checkpoints.resolve(root).name == "step-000001"
    with rlkit.launch(world_size=2) as cluster:
        trainer = rlkit.Trainer.resume(cluster, root)
        assert trainer.steps_done == 1
        trainer.step()
