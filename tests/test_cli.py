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
