"""The bundled tasks of model="tiny-agent" (``rlkit.data.agent_tasks``): the weekday tool, the date and two-tool
prompts, the default task that offers both tools, and the bundled agent picking the tool a prompt needs."""

from __future__ import annotations

import datetime
import re

import pytest
import torch

from rlkit.data.agent_tasks import DATES, WEEKDAYS, calculator, date_prompts, tool_prompts, weekday
from rlkit.data.tools import parse_hermes
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR

TASKS = {"calculator": ("expression", "*"), "weekday": ("date", "-")}
"""A tool of the two-tool task -> (its argument, the mark that only its prompts hold)."""


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


@pytest.mark.parametrize("order", [(calculator, weekday), (weekday, calculator)], ids=["calc-first", "weekday-first"])
def test_with_two_tools_listed_the_tiny_agent_calls_the_one_each_prompt_needs(order):
    """Sampled at temperature 1 (seeded) on 128 held-out prompts (70 products, 58 dates) with both tools listed:
    the agent calls the prompt's own tool on its prompt on a clear share of each task, and the other tool never.
    Measured over seeds 0-7, either order: 11-22 right calls on the products, 11-25 on the dates, none wrong (seed
    0: 14 and 16). The agent built before the weekday tool made no right call at all."""
    torch.manual_seed(0)
    rows = tool_prompts(128, 11)
    right = dict.fromkeys(TASKS, 0)
    wrong = 0
    for row, calls in zip(rows, first_turn_calls(list(order), rows), strict=True):
        prompt = row["prompt"][0]["content"]
        name = next(n for n, (_, mark) in TASKS.items() if mark in prompt)
        right[name] += any(c.name == name and c.arguments == {TASKS[name][0]: prompt} for c in calls)
        wrong += any(c.name != name for c in calls)
    assert min(right.values()) >= 6, f"right calls on 70 products and 58 dates: {right}"
    assert wrong <= 2, f"{wrong} prompts called the tool they do not need"
