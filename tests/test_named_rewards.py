"""Rewards named in the config: files and modules, signature and column checks, all problems at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from rlkit.config import ConfigError, GRPOConfig
from rlkit.config.data import DataConfig, RewardSpec
from rlkit.data.named_rewards import load_rewards, signature_problems
from rlkit.data.rewards import compute_rewards, reward_terms
from rlkit.data.run_data import load_run_data
from rlkit.models import load_tokenizer, resolve_model_dir

REWARDS = '''
def correct(prompts, completions, *, answer, **fields):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def short(prompts, completions, **fields):
    return [-len(c) / 10 for c in completions]

def needs_level(prompts, completions, *, answer, level):
    return [0.0] * len(completions)

def one_arg(completions):
    return [0.0] * len(completions)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "broken.py").write_text("def f(:\n")
    return tmp_path


def test_file_rewards_combine_with_weights(reward_dir):
    specs = [RewardSpec(function="my_rewards.py:correct", weight=2.0), RewardSpec(function="my_rewards.py:short",
                                                                                   name="brevity", weight=0.5)]
    terms = load_rewards(specs, reward_dir, ["answer"])
    assert [(t.name, t.weight) for t in terms] == [("correct", 2.0), ("brevity", 0.5)]
    total, by_name = compute_rewards(terms, ["p", "q"], ["4", "five"], {"answer": ["4", "5"]})
    torch.testing.assert_close(by_name["brevity"], torch.tensor([-0.1, -0.4]))
    torch.testing.assert_close(total, torch.tensor([2.0 - 0.05, 0.0 - 0.2]))


def test_module_path_and_cwd_fallback(reward_dir, monkeypatch):
    monkeypatch.chdir(reward_dir)
    (term,) = load_rewards([RewardSpec(function="rlkit.data.verifiable:math_reward")], None, ["answer"])
    assert term.fn(["q"], ["so \\boxed{4}"], answer=["4"]) == [1.0]
    (term,) = load_rewards([RewardSpec(function="my_rewards.py:correct")], reward_dir / "elsewhere", ["answer"])
    assert term.name == "correct"


def test_every_problem_is_reported_at_once(reward_dir):
    specs = [
        RewardSpec(function="nowhere.py:f"),
        RewardSpec(function="my_rewards.py:missing"),
        RewardSpec(function="my_rewards.py:NOT_A_FUNCTION"),
        RewardSpec(function="my_rewards.py:one_arg"),
        RewardSpec(function="my_rewards.py:needs_level"),
        RewardSpec(function="broken.py:f"),
        RewardSpec(function="no_such_package.mod:f"),
        RewardSpec(function="my_rewards.py:correct"),
    ]
    with pytest.raises(ConfigError) as err:
        load_rewards(specs, reward_dir, ["answer", "source"])
    p = err.value.problems
    assert len(p) == 8, p
    assert p[0].startswith('rewards[0].function="nowhere.py:f": no file nowhere.py (looked for')
    assert "has no 'missing' (its callables: ['correct', 'needs_level', 'one_arg', 'short'])" in p[1]
    assert "my_rewards.py:NOT_A_FUNCTION is a int, not a function" in p[2]
    assert "one_arg takes (completions) but is called as fn(prompts, completions, **fields)" in p[3]
    assert "needs_level needs the column(s) ['level'], which the data does not have" in p[4]
    assert "needs_level does not accept the field(s) ['source']" in p[5] and "add **fields" in p[5]
    assert "broken.py failed to import: SyntaxError" in p[6]
    assert "cannot import 'no_such_package.mod' (ModuleNotFoundError" in p[7]


def test_signature_checks_against_hand_written_functions():
    def star(*args, **kwargs):
        return []

    def fixed(prompts, completions, answer, extra=1):
        return []

    assert signature_problems(star, ["a", "b"]) == []
    assert signature_problems(fixed, ["answer"]) == []
    assert "does not accept the field(s) ['level']" in signature_problems(fixed, ["answer", "level"])[0]
    assert "needs the column(s) ['answer']" in signature_problems(fixed, [])[0]
    assert signature_problems(fixed, None) == []  # fields unknown: only the positional check runs


def test_file_rewards_travel_by_value_to_a_process_that_cannot_see_the_file(reward_dir, tmp_path):
    (term,) = load_rewards([RewardSpec(function="my_rewards.py:correct")], reward_dir, ["answer"])
    blob = tmp_path / "fn.pkl"
    blob.write_bytes(cloudpickle.dumps(term.fn))
    code = f"import pickle; f = pickle.load(open({str(blob)!r}, 'rb')); print(f(['q'], [' 7'], answer=['7']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert out.stdout.strip() == "[1.0]", out.stderr


def test_list_of_same_named_functions_keeps_both_terms():
    terms = reward_terms([lambda p, c, **f: [1.0] * len(c), lambda p, c, **f: [2.0] * len(c)])
    assert [t.name for t in terms] == ["<lambda>_0", "<lambda>_1"]
    total, _ = compute_rewards(terms, ["p"], ["c"], {})
    assert total.tolist() == [3.0]


def test_run_data_reports_all_acceptance_problems_together(tmp_path, reward_dir):
    """Missing file, missing column, bad reward path, wrong signature, too long, no chat template: one error."""
    tok = load_tokenizer(resolve_model_dir("tiny"))
    tok.chat_template = None  # a base model's tokenizer without one
    rows = "".join(f'{{"prompt": "{"1+1=" * n}", "answer": "2"}}\n' for n in (1, 40))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "val.jsonl").write_text('{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}\n')
    config = GRPOConfig(
        data=DataConfig(train_files=["train.jsonl", "gone.parquet"], val_files=["val.jsonl"]),
        rewards=[
            RewardSpec(function="missing.py:f"),
            RewardSpec(function=f"{reward_dir}/my_rewards.py:one_arg"),
            RewardSpec(function=f"{reward_dir}/my_rewards.py:needs_level"),
        ],
    )
    with pytest.raises(ConfigError) as err:
        load_run_data(config, tok, base_dir=tmp_path)
    p = err.value.problems
    assert len(p) == 6, p
    assert p[0].startswith('data.train_files: "gone.parquet" does not exist')
    assert "1 of 2 prompts are longer than data.max_prompt_tokens=64" in p[1]
    assert "needs a chat template but the tokenizer" in p[2]
    assert p[3].startswith('rewards[0].function="missing.py:f": no file missing.py')
    assert "one_arg takes (completions)" in p[4]
    assert "needs_level needs the column(s) ['level']" in p[5]


def test_validation_columns_must_match_training(tmp_path):
    tok = load_tokenizer(resolve_model_dir("tiny"))
    config = GRPOConfig(rewards=[RewardSpec(function="rlkit.data.verifiable:math_reward")])
    expected = r"the validation data has the fields \[\] but the training data has \['answer'\]"
    with pytest.raises(ConfigError, match=expected):
        load_run_data(config, tok, prompts=[{"prompt": "1+1=", "answer": "2"}], val_prompts=["2+2="])


def test_tiny_without_data_is_the_bundled_task_and_a_real_model_needs_data():
    tok = load_tokenizer(resolve_model_dir("tiny"))
    run = load_run_data(GRPOConfig(), tok)
    assert [t.name for t in run.rewards] == ["addition_reward"] and run.val is None and run.reports == []
    assert set(run.train.next(1)[0]) == {"prompt", "answer"}
    model_dir = str(Path(resolve_model_dir("tiny")))
    with pytest.raises(ConfigError) as err:
        load_run_data(GRPOConfig(model=model_dir), tok)
    assert err.value.problems == [
        'data.train_files is empty: name the prompt files (or pass prompts in Python); only model="tiny" '
        "has a bundled task",
        'no reward: add [[rewards]] function = "my_rewards.py:correct" to the config, pass reward_fn, '
        "or set reward_model.path",
    ]


def test_shipped_config_and_dataset_load(monkeypatch):
    """configs/your_run.toml: its dataset and reward file load (the tiny tokenizer's chat template renders them)."""
    from rlkit.config import config_from_toml

    root = Path(__file__).resolve().parents[1]
    config = config_from_toml(root / "configs" / "your_run.toml")
    tok = load_tokenizer(resolve_model_dir("tiny"))
    monkeypatch.chdir("/")
    run = load_run_data(config, tok, base_dir=root / "configs")
    assert (run.reports[0].kept, run.reports[1].kept) == (256, 64)
    assert config.trackers == ["tensorboard"] and config.validation.every == 5
    item = run.val.items[0]
    assert item["prompt"].endswith("=") and run.rewards[0].fn([""], [item["answer"]], answer=[item["answer"]]) == [1.0]
    train = {r["prompt"] for r in run.train.items}
    assert not train & {r["prompt"] for r in run.val.items}
