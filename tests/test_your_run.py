"""Your own run with no Python: every problem of its data files, prompt column and reward files is reported at
once before launch. (`rlkit train` on such a TOML, its folder and a resume: tests/test_cli.py; the same history
from Python: notebooks/06_your_own_run.ipynb.)"""

import textwrap
from pathlib import Path

from rlkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "rlkit" / "data" / "examples" / "addition"


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
