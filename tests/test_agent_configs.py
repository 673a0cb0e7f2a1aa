"""The shipped multi-turn configs run with `rlkit train` as they are (a step each, one worker): configs/agent_tools.toml
(the tiny agent with the calculator and weekday tools) and configs/agent_env.toml (guess-the-number, its rows in
rlkit/data/examples/guess)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pandas as pd
import pytest

from rlkit.cli import main
from rlkit.config import config_from_toml
from rlkit.data.agent_tasks import guess_prompts

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def test_the_guessing_rows_are_the_bundled_games():
    """rlkit/data/examples/guess/train.jsonl is guess_prompts(64, seed=0), as agent_env.toml says."""
    lines = (ROOT / "rlkit" / "data" / "examples" / "guess" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == guess_prompts(64, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, figure", [("agent_tools", "agent/tool_use_frac"), ("agent_env", "agent/env_reward/mean")]
)
def test_a_shipped_agent_config_trains_a_step(name, figure, tmp_path):
    path = CONFIGS / f"{name}.toml"
    config = config_from_toml(path)
    assert config.model == "tiny-agent" and (config.tools or config.environment)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", str(path), "--steps", "1", "--world-size", "1", "--output-dir", str(tmp_path)])
    assert code == 0, out.getvalue() + err.getvalue()
    assert "multi-turn: tools" in out.getvalue() and "done: 1 step," in out.getvalue(), out.getvalue()
    history = pd.read_csv(tmp_path / "history.csv")
    assert len(history) == 1 and history["agent/turns/mean"][0] >= 1 and history[figure][0] >= 0
    assert history["agent/env_errors"][0] == 0 and history["agent/failed_calls_frac"][0] == 0


def convert_units(value: float, unit: str, to: str) -> str:
    """Convert a quantity between units.

    Args:
        value: the amount.
        unit: its unit, e.g. "km".
        to: the unit wanted, e.g. "mi".
    """
    return f"{value} {unit} in {to}"


def test_the_tiny_agent_warns_of_tools_it_was_never_taught(caplog):
    """Listed beside the calculator, a unit converter of the user's own (not the bundled ``convert``, which it was
    pre-trained with) can stop the tiny agent calling any tool (the agent at 79ff466 called the calculator on 0 of
    32 products, against 10 of 32 with the calculator alone): a warning names the tool and the fix; its own three
    tools give none."""
    from rlkit.config import GRPOConfig
    from rlkit.data import load_run_data
    from rlkit.data.agent_tasks import answer_reward, calculator, convert, product_prompts, weekday
    from rlkit.models import load_tokenizer
    from rlkit.models.tiny import TINY_AGENT_DIR

    tokenizer, config = load_tokenizer(TINY_AGENT_DIR), GRPOConfig(model="tiny-agent")
    rows = product_prompts(4, seed=0)
    with caplog.at_level("WARNING", logger="rlkit.data.run_data"):
        load_run_data(config, tokenizer, prompts=rows, reward_fn=answer_reward, tools=[calculator, weekday, convert])
        assert caplog.records == []
        load_run_data(config, tokenizer, prompts=rows, reward_fn=answer_reward, tools=[calculator, convert_units])
    (record,) = caplog.records
    assert "with ['convert_units'] listed it may call no tool at all" in record.getMessage()
