"""Your own run with no Python: a TOML file names the data files, the prompt column, a reward file, validation
and a tracker; `rlkit train` runs it, Python gives the same history, and a resume continues at the same data."""

import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import rlkit
from rlkit.cli import main
from rlkit.config import config_from_toml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "rlkit" / "data" / "examples" / "addition"
COMPARED = ["step", "reward/mean", "reward/correct/mean", "kl/mean", "response/length/mean", "actor/loss"]
"""The history columns that must agree between the CLI and Python (timings and memory differ)."""


def write_run(folder: Path, steps: int = 3) -> Path:
    """configs/your_run.toml's shape, small: data and reward file beside the TOML, TensorBoard in the folder."""
    shutil.copy(ROOT / "configs" / "rewards" / "addition.py", folder / "rewards.py")
    toml = folder / "run.toml"
    toml.write_text(
        textwrap.dedent(
            f"""
            model = "tiny"
            steps = {steps}
            prompts_per_step = 4
            group_size = 4
            trackers = ["tensorboard"]
            run_dir = "{folder / "runs"}"
            [data]
            train_files = "{DATA / "train.parquet"}"
            val_files = "{DATA / "val.parquet"}"
            prompt_key = "prompt"
            [[rewards]]
            function = "rewards.py:correct"
            [validation]
            every = 2
            n = 2
            [rollout]
            max_new_tokens = 6
            """
        )
    )
    return toml


@pytest.mark.timeout(400)
def test_a_toml_run_trains_from_the_cli_and_python_gives_the_same_history(tmp_path, capsys):
    toml = write_run(tmp_path)
    assert main(["train", str(toml), "--report", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "train prompts: 256 of 256" in out and "rewards: correct x 1" in out and "val reward" in out
    (run_dir,) = (tmp_path / "runs").iterdir()
    cli = pd.read_csv(run_dir / "history.csv")
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "the tracker wrote no event file"
    with rlkit.launch(world_size=2) as cluster:
        history = rlkit.Trainer(cluster, config_from_toml(toml)).fit(progress=False)
    pd.testing.assert_frame_equal(cli[COMPARED], history[COMPARED], check_dtype=False)
    assert history["val/reward/mean"].notna().tolist() == [False, True, False]
    assert {"val/reward/pass@1", "val/reward/pass@2"} <= set(history.columns)


@pytest.mark.timeout(400)
def test_resume_continues_at_the_same_data_position(tmp_path):
    config = config_from_toml(write_run(tmp_path, steps=4))
    config.trackers = []
    with rlkit.launch(world_size=2) as cluster:
        straight = rlkit.Trainer(cluster, config)
        straight.fit(progress=False)
        expected_prompts = straight.last_batch.prompts
        expected = straight.history
    with rlkit.launch(world_size=2) as cluster:
        first = rlkit.Trainer(cluster, config)
        first.fit(2, progress=False)
        saved = first.save(tmp_path / "ckpt")
    with rlkit.launch(world_size=2) as cluster:
        resumed = rlkit.Trainer.resume(cluster, saved)
        resumed.fit(2, progress=False)
        assert resumed.last_batch.prompts == expected_prompts, "the resumed run drew other prompts"
        history = resumed.history
    pd.testing.assert_frame_equal(history[COMPARED], expected[COMPARED])


def test_every_data_problem_is_reported_at_once_before_launch(tmp_path, capsys):
    (tmp_path / "wrong.py").write_text("def correct(prompts):\n    return [0.0] * len(prompts)\n")
    toml = tmp_path / "bad.toml"
    toml.write_text(
        textwrap.dedent(
            f"""
            model = "tiny"
            [data]
            train_files = "{DATA / "train.parquet"}"
            val_files = "missing.parquet"
            prompt_key = "question"
            [[rewards]]
            function = "nowhere.py:correct"
            [[rewards]]
            function = "wrong.py:correct"
            """
        )
    )
    assert main(["train", str(toml)]) == 2
    err = capsys.readouterr().err
    for problem in ("missing.parquet", "question", "nowhere.py", "wrong.py"):
        assert problem in err, f"{problem!r} not named in:\n{err}"
    assert "[rank" not in err, "workers were launched"
