"""Prompt sources from files and Python objects: formats, chat templates, long prompts, fields, resume."""

from __future__ import annotations

import json
import random

import datasets
import pandas as pd
import pytest

from rlkit.config import ConfigError
from rlkit.config.data import DataConfig
from rlkit.data.loading import load_prompt_source
from rlkit.data.prompts import PromptSource
from rlkit.models import load_tokenizer, resolve_model_dir

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(6)]


@pytest.fixture(scope="module")
def plain_tokenizer():
    """The tiny tokenizer without its chat template (as many base models' tokenizers come)."""
    tok = load_tokenizer(resolve_model_dir("tiny"))
    tok.chat_template = None
    return tok


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = load_tokenizer(resolve_model_dir("tiny"))
    tok.chat_template = TEMPLATE
    return tok


def load(data: DataConfig, tok, limit: int = 64, **kw):
    return load_prompt_source(data, tok, 0, max_prompt_tokens=limit, **kw)


def write(path, rows, fmt):
    df = pd.DataFrame(rows)
    if fmt == "parquet":
        df.to_parquet(path)
    elif fmt == "csv":
        df.to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_files_in_every_format_give_the_same_items(tmp_path, plain_tokenizer, fmt):
    write(tmp_path / f"train.{fmt}", ROWS, fmt)
    source, report = load(DataConfig(train_files=[f"train.{fmt}"]), plain_tokenizer, base_dir=tmp_path)
    answer = int if fmt == "csv" else str  # csv has no types: the column of digits reads as integers
    assert source.items == [{"prompt": r["prompt"], "answer": answer(r["answer"]), "level": r["level"]} for r in ROWS]
    assert (report.rows, report.kept, report.fields, report.templated) == (6, 6, ["answer", "level"], False)
    assert source.add_special_tokens is True


def test_several_files_concatenate_and_a_saved_dataset_folder_reads(tmp_path, plain_tokenizer):
    write(tmp_path / "a.jsonl", ROWS[:2], "jsonl")
    datasets.Dataset.from_list(ROWS[2:]).save_to_disk(str(tmp_path / "saved"))
    source, report = load(DataConfig(train_files=["a.jsonl", str(tmp_path / "saved")]), plain_tokenizer,
                          base_dir=tmp_path)
    assert [r["prompt"] for r in source.items] == [r["prompt"] for r in ROWS]


def test_python_prompts_dataset_dicts_and_strings(plain_tokenizer):
    data = DataConfig()
    from_ds, _ = load(data, plain_tokenizer, prompts=datasets.Dataset.from_list(ROWS))
    from_dicts, _ = load(data, plain_tokenizer, prompts=ROWS)
    from_strings, report = load(data, plain_tokenizer, prompts=[r["prompt"] for r in ROWS])
    assert from_ds.items == from_dicts.items == [{"prompt": r["prompt"], "answer": r["answer"], "level": r["level"]}
                                                 for r in ROWS]
    assert from_strings.items == [{"prompt": r["prompt"]} for r in ROWS] and report.fields == []


def test_relative_paths_look_next_to_the_toml_then_in_the_cwd(tmp_path, plain_tokenizer, monkeypatch):
    (tmp_path / "cfg").mkdir()
    write(tmp_path / "cwd.jsonl", ROWS[:1], "jsonl")
    write(tmp_path / "cfg" / "near.jsonl", ROWS[1:2], "jsonl")
    monkeypatch.chdir(tmp_path)
    source, _ = load(DataConfig(train_files=["near.jsonl", "cwd.jsonl"]), plain_tokenizer, base_dir=tmp_path / "cfg")
    assert [r["prompt"] for r in source.items] == ["1+1=", "0+1="]


def test_messages_go_through_the_chat_template_with_the_generation_prompt(chat_tokenizer):
    rows = [{"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}], "answer": "4"}]
    source, report = load(DataConfig(prompt_key="messages"), chat_tokenizer, prompts=rows)
    assert source.items == [{"prompt": "<system>add<user>2+2=<a>", "answer": "4"}]
    assert report.templated and source.add_special_tokens is False
    strings, _ = load(DataConfig(chat_template=True), chat_tokenizer, prompts=["3+3="])
    assert strings.items == [{"prompt": "<user>3+3=<a>"}]
    untouched, _ = load(DataConfig(), chat_tokenizer, prompts=["3+3="])
    assert untouched.items == [{"prompt": "3+3="}]


def test_chat_problems_name_the_fix(plain_tokenizer, chat_tokenizer):
    chat = [{"prompt": [{"role": "user", "content": "1+1="}]}]
    with pytest.raises(ConfigError, match="has none: add \"chat_template\" to its tokenizer_config.json"):
        load(DataConfig(), plain_tokenizer, prompts=chat)
    with pytest.raises(ConfigError, match="data.chat_template = false: set chat_template = true"):
        load(DataConfig(chat_template=False), chat_tokenizer, prompts=chat)
    with pytest.raises(ConfigError, match=r"mixes plain strings \(row 1\) and chat messages \(row 0\)"):
        load(DataConfig(), chat_tokenizer, prompts=chat + [{"prompt": "x"}])
    with pytest.raises(ConfigError, match="2 row\\(s\\) are neither"):
        load(DataConfig(), chat_tokenizer, prompts=[{"prompt": ""}, {"prompt": [{"role": "user"}]}])


def test_long_prompts_are_rejected_or_dropped_with_count_and_examples(plain_tokenizer, caplog):
    rows = [{"prompt": "1+1="}, {"prompt": "12345+67890=" * 4}, {"prompt": "2+2="}, {"prompt": "99+99=" * 5}]
    lengths = [len(plain_tokenizer(r["prompt"])["input_ids"]) for r in rows]
    limit = max(lengths[0], lengths[2])
    with pytest.raises(ConfigError) as err:
        load(DataConfig(), plain_tokenizer, limit, prompts=rows)
    (problem,) = err.value.problems
    assert f"2 of 4 prompts are longer than data.max_prompt_tokens={limit}" in problem
    assert f"raise data.max_prompt_tokens to {max(lengths)}" in problem and 'long_prompts = "drop"' in problem
    assert f"row 1 ({lengths[1]} tokens)" in problem and f"row 3 ({lengths[3]} tokens)" in problem
    with caplog.at_level("WARNING", logger="rlkit.data.loading"):
        source, report = load(DataConfig(long_prompts="drop"), plain_tokenizer, limit, prompts=rows)
    assert [r["prompt"] for r in source.items] == ["1+1=", "2+2="]
    assert (report.rows, report.kept, report.dropped, report.longest) == (4, 2, 2, limit)
    assert "dropped 2 over max_prompt_tokens" in caplog.text and f"row 1 ({lengths[1]} tokens)" in caplog.text
    with pytest.raises(ConfigError, match="every prompt is longer"):
        load(DataConfig(long_prompts="drop"), plain_tokenizer, 1, prompts=rows)


def test_file_and_column_problems_are_reported_together(tmp_path, plain_tokenizer):
    write(tmp_path / "ok.jsonl", ROWS, "jsonl")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError) as err:
        load(DataConfig(train_files=["missing.parquet", "notes.txt", "ok.jsonl"]), plain_tokenizer, base_dir=tmp_path)
    assert len(err.value.problems) == 2
    assert 'data.train_files: "missing.parquet" does not exist (looked for' in err.value.problems[0]
    assert "is a .txt file" in err.value.problems[1]
    with pytest.raises(ConfigError, match=r"prompt_key=\"question\" is not a column of ok.jsonl \(its columns"):
        load(DataConfig(train_files=["ok.jsonl"], prompt_key="question"), plain_tokenizer, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"has the column\(s\) \['prompt'\]"):
        load(DataConfig(prompt_key="q"), plain_tokenizer, prompts=[{"q": "1+1=", "prompt": "x"}])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"holds the splits \['train'\]: give one split's folder"):
        load(DataConfig(train_files=["dd"]), plain_tokenizer, base_dir=tmp_path)


def test_val_split_keeps_file_order(tmp_path, plain_tokenizer):
    write(tmp_path / "val.jsonl", ROWS, "jsonl")
    source, report = load(DataConfig(val_files="val.jsonl"), plain_tokenizer, base_dir=tmp_path, split="val")
    assert [r["prompt"] for r in source.items] == [r["prompt"] for r in ROWS] and report.split == "val"


def test_each_epoch_is_a_fresh_permutation_and_resume_continues_exactly():
    items = [f"p{i}" for i in range(5)]
    straight = PromptSource(items, seed=3)
    served = [r["prompt"] for r in straight.next(15)]
    for epoch in range(3):
        assert sorted(served[5 * epoch : 5 * epoch + 5]) == items
    assert served[:5] != served[5:10] or served[5:10] != served[10:15]
    first = PromptSource(items, seed=3)
    first.next(7)
    resumed = PromptSource(items, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert [r["prompt"] for r in resumed.next(8)] == served[7:]
    order = list(range(5))
    random.Random("3:epoch0").shuffle(order)
    assert served[:5] == [items[i] for i in order]
    with pytest.raises(ValueError, match="saved prompt position is for 5 prompts but this source has 4"):
        PromptSource(items[:4], seed=3).load_state_dict(first.state_dict())
