"""Checkpoints: exact resume across a relaunch, atomic saves, keep-last-K, a Hugging Face export."""

import contextlib
import io
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
    shape = checkpoints.read_meta(saved)["models"]["model"]["shape"]  # what a resume's model is held against
    assert (shape["model_type"], shape["hidden_size"], shape["intermediate_size"]) == ("qwen2", 128, 256)

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


# -- a resume whose model has other shapes is named before any worker loads (checkpoints.resume_problems) ----------


class Untouchable:
    """A cluster that fails the test when anything is asked of it: the check must come before."""

    def __getattr__(self, name):
        raise AssertionError(f"cluster.{name} was used before the model was checked")


def changed_tiny(folder, **fields):
    """A copy of the tiny model with ``fields`` changed in its config.json (intermediate_size=384: a wider MLP)."""
    import json
    import shutil

    from rlkit.models.tiny import TINY_MODEL_DIR

    shutil.copytree(TINY_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


def saved_checkpoint(root, config, *, recorded=True):
    """A checkpoint's trainer.json as Trainer.save writes it (``recorded=False``: as rlkit wrote it before it
    recorded the models' shapes); nothing else is read before the workers load."""
    import json

    path = root / "checkpoints" / "step-000003"
    path.mkdir(parents=True)
    meta = {"config": config.to_dict(), "steps_done": 3, "prompts": {}, "history": []}
    if recorded:
        meta["models"] = checkpoints.model_record(config.to_dict())
    (path / checkpoints.META).write_text(json.dumps(meta))
    return path


def test_resuming_with_a_model_of_other_shapes_names_both_models_before_the_cluster_is_used(tmp_path):
    wider = changed_tiny(tmp_path / "wider", intermediate_size=384)
    saved = saved_checkpoint(tmp_path / "run", rlkit.GRPOConfig(**CONFIG))
    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.Trainer.resume(Untouchable(), saved, config=rlkit.GRPOConfig(**{**CONFIG, "model": str(wider)}))
    assert err.value.problems == [
        f'the checkpoint step-000003 was trained from model = "tiny" (intermediate_size 256); the config\'s model = '
        f'"{wider}" has intermediate_size 384: its tensors have other shapes. Resume with model = "tiny", or start a '
        "new run (without --resume, in another output_dir)"
    ]


def test_a_model_folder_changed_since_the_checkpoint_is_named_and_a_moved_one_resumes(tmp_path):
    """The same ``model`` setting whose folder now holds another model (the checkpoint recorded the shapes), and
    a copy of the same model elsewhere (same shapes: no problem)."""
    model = changed_tiny(tmp_path / "model")
    saved = saved_checkpoint(tmp_path / "run", rlkit.GRPOConfig(**{**CONFIG, "model": str(model)}))
    moved = changed_tiny(tmp_path / "moved")
    assert checkpoints.resume_problems(saved, rlkit.GRPOConfig(**{**CONFIG, "model": str(moved)})) == []
    changed_tiny(tmp_path / "rebuilt", hidden_size=96, num_hidden_layers=3)
    (model / "config.json").write_text((tmp_path / "rebuilt" / "config.json").read_text())
    with pytest.raises(rlkit.ConfigError, match=rf'trained from model = "{model}" \(hidden_size 128, '
                       rf'num_hidden_layers 2\); the config\'s model = "{model}" is now hidden_size 96, '
                       rf'num_hidden_layers 3: .* Resume with model = "{model}" as it was'):  # fmt: skip
        rlkit.Trainer.resume(Untouchable(), saved)  # no config: the checkpoint's own, against its folder now


def test_a_checkpoint_of_an_earlier_version_is_held_against_its_model_folder_as_it_is_now(tmp_path):
    wider = changed_tiny(tmp_path / "wider", intermediate_size=384)
    saved = saved_checkpoint(tmp_path / "run", rlkit.GRPOConfig(**CONFIG), recorded=False)
    assert checkpoints.resume_problems(saved, rlkit.GRPOConfig(**CONFIG)) == []
    (problem,) = checkpoints.resume_problems(saved, rlkit.GRPOConfig(**{**CONFIG, "model": str(wider)}))
    assert problem.startswith('the checkpoint step-000003 was trained from model = "tiny" (intermediate_size 256)')


def test_the_critic_and_a_preference_run_are_checked_too(tmp_path):
    wider = changed_tiny(tmp_path / "wider", intermediate_size=384)
    ppo = saved_checkpoint(tmp_path / "ppo", rlkit.PPOConfig(model="tiny"))
    (problem,) = checkpoints.resume_problems(ppo, rlkit.PPOConfig(model="tiny", critic={"model": str(wider)}))
    assert problem.startswith('the checkpoint step-000003 was trained from critic.model = "tiny" (intermediate_size '
                              f'256); the config\'s critic.model = "{wider}" has intermediate_size 384')  # fmt: skip
    dpo = saved_checkpoint(tmp_path / "dpo", rlkit.DPOConfig())
    with pytest.raises(rlkit.ConfigError, match='trained from model = "tiny"'):
        rlkit.PreferenceTrainer.resume(Untouchable(), dpo, config=rlkit.DPOConfig(model=str(wider)))


def test_rlkit_train_names_a_changed_model_before_launch(tmp_path, monkeypatch):
    """``rlkit train --resume auto`` with the model changed in the TOML: one message naming both models, exit 2,
    nothing launched, no rank tracebacks."""
    import rlkit.cli.train
    from rlkit.cli import main

    monkeypatch.setattr(rlkit.cli.train, "launch", Untouchable())
    wider = changed_tiny(tmp_path / "wider", intermediate_size=384)
    saved_checkpoint(tmp_path / "run", rlkit.GRPOConfig(**CONFIG))
    toml = tmp_path / "c.toml"
    toml.write_text(f'model = "{wider}"\noutput_dir = "{tmp_path / "run"}"\n[checkpoint]\nevery = 1\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(toml), "--resume", "auto"])
    assert code == 2 and "Traceback" not in err.getvalue()
    assert (f'the checkpoint step-000003 was trained from model = "tiny" (intermediate_size 256); the config\'s '
            f'model = "{wider}" has intermediate_size 384') in err.getvalue()  # fmt: skip


def test_a_resume_that_fails_in_the_workers_still_offers_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    """The trainer never started, the checkpoint is still there: "then resume with", not "nothing to resume from"."""
    import rlkit.cli.train
    from rlkit.cli import main

    class Cluster:
        closed = False

    @contextlib.contextmanager
    def launch(**kwargs):
        yield Cluster()

    def resume(cls, cluster, path, **kwargs):
        raise RuntimeError("Error(s) in loading state_dict: size mismatch")

    monkeypatch.setattr(rlkit.cli.train, "launch", launch)
    monkeypatch.setattr(rlkit.Trainer, "resume", classmethod(resume))
    saved_checkpoint(tmp_path / "run", rlkit.GRPOConfig(**CONFIG), recorded=False)
    toml = tmp_path / "c.toml"
    toml.write_text(f'model = "tiny"\noutput_dir = "{tmp_path / "run"}"\n[checkpoint]\nevery = 1\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(toml), "--resume", "auto", "--world-size", "1"])
    said = err.getvalue()
    assert code == 1 and "RuntimeError: Error(s) in loading state_dict: size mismatch" in said, said
    assert f"kept in {tmp_path / 'run'}: checkpoint step-000003" in said
    assert "then resume with: rlkit train" in said and "nothing to resume from" not in said


def test_a_save_that_fails_leaves_no_partial_folder_and_the_earlier_one_whole(tmp_path):
    final = tmp_path / "state"
    final.mkdir()
    (final / "weights").write_text("earlier")
    with pytest.raises(OSError, match="disk full"), checkpoints.written_in_place(final) as partial:
        (partial / "weights").write_text("half")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # no .state.partial-*
    assert (final / "weights").read_text() == "earlier"
    with checkpoints.written_in_place(final) as partial:
        (partial / "weights").write_text("later")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # no .state.old-* either
    assert (final / "weights").read_text() == "later"
