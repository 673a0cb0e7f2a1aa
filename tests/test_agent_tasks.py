"""The bundled tasks of model="tiny-agent" (``rlkit.data.agent_tasks``): the weekday tool, the date and two-tool
prompts."""

from __future__ import annotations

import datetime
import re

import pytest

from rlkit.data.agent_tasks import DATES, WEEKDAYS, calculator, date_prompts, tool_prompts, weekday


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
