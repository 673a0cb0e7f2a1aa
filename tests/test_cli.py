"""`rlkit train`: one line per step and an offline HTML report."""

import re

import pytest

from rlkit.cli import main


@pytest.mark.timeout(300)
def test_train_prints_a_line_per_step_and_writes_an_offline_report(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('model = "tiny"\nprompts_per_step = 4\ngroup_size = 4\n[rollout]\nmax_new_tokens = 6\n')
    report = tmp_path / "r.html"
    assert main(["train", str(config), "--steps", "3", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d\.\d{3}\s", line)]
    assert len(steps) == 3, out
    assert all("rollout=" in line and "sync=" in line for line in steps)
    page = report.read_text()
    assert "reward/mean" in page and "Plotly.newPlot" in page
    assert not re.search(r"<script[^>]+src=[\"']https?://", page), "the report must not load scripts from the network"


def test_bad_config_is_reported_before_launch(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("group_size = 1\nprompts_per_step = 3\n")
    assert main(["train", str(config)]) == 2
    assert "group_size=1" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_setting_that_will_not_fit_is_warned_before_launch_with_the_fix(tmp_path, capsys, monkeypatch):
    """On a (pretended) GPU of 0.01 GiB the estimate's peak does not fit: the CLI says so, with the fixes,
    before any worker starts."""
    import rlkit.cli

    monkeypatch.setattr(rlkit.cli, "visible_gpu_memory_gib", lambda: 0.01)
    config = tmp_path / "c.toml"
    config.write_text('model = "tiny"\nprompts_per_step = 2\ngroup_size = 2\n[rollout]\nmax_new_tokens = 4\n')
    assert main(["train", str(config), "--steps", "1", "--report", str(tmp_path / "r.html")]) == 0
    captured = capsys.readouterr()
    assert "memory-will-not-fit" in captured.err and "fix:" in captured.err


@pytest.mark.timeout(300)
def test_train_runs_dpo_from_a_toml_with_pairs_beside_it(tmp_path, capsys):
    import pandas as pd

    from rlkit.data.preferences import SHIPPED_DIR

    pd.read_parquet(SHIPPED_DIR / "dpo.parquet").head(16).to_parquet(tmp_path / "pairs.parquet")
    config = tmp_path / "dpo.toml"
    config.write_text(
        'algorithm = "dpo"\nmodel = "tiny"\ntrain_files = "pairs.parquet"\nbatch_size = 8\nbeta = 0.5\n'
        f'run_dir = "{tmp_path / "runs"}"\n[optim]\nlr = 2e-4\n'
    )
    report = tmp_path / "r.html"
    assert main(["train", str(config), "--steps", "3", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "dpo examples: 16 from train_files" in out and str(tmp_path / "pairs.parquet") in out
    steps = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d\.\d{3}\s+-?\d\.\d{3}\s", line)]
    assert len(steps) == 3 and steps[0].split()[1:4] == ["0.000", "0.000", "0.6931"], out
    assert "preference accuracy: first 3 steps" in out
    assert "rewards/accuracy" in report.read_text()
    assert main(["train", str(config), "--rollout", "vllm"]) == 2
    assert "DPO samples nothing (no rollout)" in capsys.readouterr().err
