"""The bundled tasks of model="tiny-agent" (``rlkit.data.agent_tasks``): the weekday and unit-converter tools, the
date, conversion and two-tool prompts, the default task that offers two tools, and the bundled agent picking the
tool a prompt needs among two or three."""

from __future__ import annotations

import datetime
import random
import re

import pytest
import torch

from rlkit.data.agent_tasks import (
    DATES,
    TOOLS,
    WEEKDAYS,
    calculator,
    conversion_prompts,
    convert,
    date_prompts,
    product_prompts,
    tool_prompts,
    weekday,
)
from rlkit.data.tools import parse_hermes
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR

TASKS = {"calculator": ("expression", product_prompts), "weekday": ("date", date_prompts),
         "convert": ("quantity", conversion_prompts)}  # fmt: skip
"""A bundled tool -> (its argument, the prompts of its task)."""


def test_weekday_names_the_day_of_a_date_and_refuses_what_is_not_one():
    dates = ["1900-01-01", "2000-02-29", "2026-12-04", " 2099-12-31 "]
    assert [weekday(d) for d in dates] == ["Monday", "Tuesday", "Friday", "Thursday"]
    for bad in ("2026-13-01", "4 December 2026", "482*37"):
        expected = f"weekday takes a date written year-month-day .*, got {re.escape(repr(bad))}"
        with pytest.raises(ValueError, match=expected):
            weekday(bad)


def test_date_prompts_are_seeded_days_of_both_centuries_answered_by_their_weekday():
    rows = date_prompts(300, 3)
    assert rows == date_prompts(300, 3) and rows != date_prompts(300, 4)
    days = [datetime.date.fromisoformat(r["prompt"][0]["content"]) for r in rows]
    assert all(DATES[0] <= d <= DATES[1] for d in days) and {d.year // 100 for d in days} == {19, 20}
    assert [r["answer"] for r in rows] == [weekday(d.isoformat()) for d in days]
    assert set(r["answer"] for r in rows) == set(WEEKDAYS)


def test_convert_works_out_each_unit_both_ways_to_two_decimals_and_refuses_the_rest():
    quantities = ["37 mi to km", "100 km to mi", "12 in to cm", "100 cm to in", "10 lb to kg", " 2.5 kg to lb "]
    # 37 * 1.609344 = 59.5457; 100 / 1.609344 = 62.1371; 12 * 2.54 = 30.48; 100 / 2.54 = 39.3701;
    # 10 * 0.45359237 = 4.5359; 2.5 / 0.45359237 = 5.5116
    assert [convert(q) for q in quantities] == ["59.55", "62.14", "30.48", "39.37", "4.54", "5.51"]
    for bad in ("3 m to mi", "37 mi in km", "37 km to km", "mi to km", "-3 mi to km", "", "482*37"):
        expected = f'convert takes "<amount> <unit> to <unit>" .*, got {re.escape(repr(bad))}'
        with pytest.raises(ValueError, match=expected):
            convert(bad)


def test_conversion_prompts_are_seeded_amounts_of_every_unit_pair_both_ways_answered_by_convert():
    rows = conversion_prompts(300, 3)
    assert rows == conversion_prompts(300, 3) and rows != conversion_prompts(300, 4)
    parts = [r["prompt"][0]["content"].split(" ") for r in rows]
    assert all(len(p) == 4 and p[2] == "to" and 10 <= int(p[0]) <= 999 for p in parts), parts[:3]
    pairs = {(p[1], p[3]) for p in parts}
    assert pairs == {("mi", "km"), ("km", "mi"), ("in", "cm"), ("cm", "in"), ("lb", "kg"), ("kg", "lb")}
    assert [r["answer"] for r in rows] == [convert(r["prompt"][0]["content"]) for r in rows]


def test_tool_prompts_mix_products_and_dates_each_answered_by_its_tool():
    rows = tool_prompts(400, 0)
    assert rows == tool_prompts(400, 0)
    contents = [r["prompt"][0]["content"] for r in rows]
    products = sum("*" in c for c in contents)
    assert 150 < products < 250, f"about half are products: {products} of 400"
    assert [r["answer"] for r in rows] == [calculator(c) if "*" in c else weekday(c) for c in contents]


def test_the_default_agent_task_offers_both_tools_and_given_tools_replace_them():
    """model="tiny-agent" without data: products and dates, both tools listed in every prompt; tools given in
    Python replace the bundled two."""
    from rlkit.config import GRPOConfig
    from rlkit.data import load_run_data

    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    run = load_run_data(GRPOConfig(model="tiny-agent"), tokenizer)
    assert run.agent is not None and [t.name for t in run.agent.tools] == ["calculator", "weekday"]
    rows = run.train.next(16)
    assert all("calculator(expression)\nweekday(date)" in r["prompt"] for r in rows), rows[0]["prompt"]
    assert {r["answer"] in WEEKDAYS for r in rows} == {True, False}, "products and dates"
    run = load_run_data(GRPOConfig(model="tiny-agent"), tokenizer, tools=[calculator])
    assert run.agent is not None and [t.name for t in run.agent.tools] == ["calculator"]


@torch.no_grad()
def first_turn_calls(tools: list, rows: list[dict]) -> list[list]:
    """The tiny agent's first turn on each of ``rows`` with ``tools`` listed, sampled at temperature 1: its calls."""
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    model = load_causal_lm(TINY_AGENT_DIR, dtype=torch.float32, device=torch.device("cpu"))
    texts = [tokenizer.apply_chat_template(r["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
             for r in rows]  # fmt: skip
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    turns = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [parse_hermes(text) for text in turns]


TOOL_SETS = [(calculator, weekday), (weekday, calculator), (calculator, convert), (convert, calculator),
             (weekday, convert), (convert, weekday), TOOLS]  # fmt: skip


@pytest.mark.parametrize("tools", TOOL_SETS, ids=lambda tools: "+".join(t.__name__ for t in tools))
def test_with_several_tools_listed_the_tiny_agent_calls_the_one_each_prompt_needs(tools):
    """Sampled at temperature 1 (seeded) on 64 held-out prompts of each task (products, dates, conversions) with
    two of the tools or all three listed, in either order: the agent calls the prompt's own tool, with the prompt
    as its argument, on a clear share of each task whose tool is listed, and another tool (one listed for another
    task, or one of a task whose tool is not listed) nearly never. Measured over seeds 0-7, every set: 7-33 right
    calls of 64 per listed task (seed 0: 13-29), another tool on 0-1 of the 192 prompts. The agent at 79ff466 knew
    no converter: 0 right calls of the conversions in every set that lists it, 0 of the dates with all three
    listed, 0-3 of the products with the converter listed after the calculator."""
    torch.manual_seed(0)
    rows = {name: prompts(64, 11) for name, (_, prompts) in TASKS.items()}
    listed = [t.__name__ for t in tools]
    tasks = [(name, row) for name in TASKS for row in rows[name]]
    right, wrong = dict.fromkeys(listed, 0), 0
    for (name, row), calls in zip(tasks, first_turn_calls(list(tools), [row for _, row in tasks]), strict=True):
        prompt = row["prompt"][0]["content"]
        if name in listed:
            right[name] += any(c.name == name and c.arguments == {TASKS[name][0]: prompt} for c in calls)
        wrong += any(c.name != name for c in calls)
    assert min(right.values()) >= 5, f"right calls on 64 prompts of each task whose tool is listed: {right}"
    assert wrong <= 4, f"{wrong} of 192 prompts called a tool they do not need"


def test_the_build_trains_on_the_ids_a_rollout_appends(monkeypatch):
    """scripts/build_tiny_agent.py encodes each training conversation as a trajectory holds it (the prompt, each
    model turn through its end-of-turn token, the observation's ids, by rlkit's renderer): no drift from a re-render
    of the conversation, and the labels are exactly the model's turns."""
    import importlib.util
    import sys
    from pathlib import Path

    from transformers.utils import get_json_schema

    from rlkit.data.chat import ChatRenderer

    path = Path(__file__).resolve().parents[1] / "scripts" / "build_tiny_agent.py"
    spec = importlib.util.spec_from_file_location("build_tiny_agent", path)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, build)  # its dataclass looks its module up there
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what the script sets, undone after the test
    spec.loader.exec_module(build)
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    question = "37 mi to km"
    call = build.call_text(build.CONVERSION_TASK, question)
    conversations = [
        ([{"role": "user", "content": question}, {"role": "assistant", "content": call},
          {"role": "tool", "content": "59.55"}, {"role": "assistant", "content": "59.55"}], [weekday, convert]),
        (build.guess_conversation(random.Random(3)), []),
    ]  # fmt: skip
    for messages, tools in conversations:
        renderer = ChatRenderer(tokenizer, [get_json_schema(t) for t in tools])
        ids, labels = build.encode(renderer, messages)
        assert renderer.drift(messages, ids) == ""
        assert len(labels) == len(ids) and all(label in (-100, i) for label, i in zip(labels, ids, strict=True))
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        learnt = tokenizer.decode([label for label in labels if label != -100])
        assert learnt == "".join(f"{turn}<|im_end|>" for turn in turns)
