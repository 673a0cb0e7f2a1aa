"""The bundled multi-turn tasks of ``model="tiny-agent"``: products and dates with a tool each, and guess-the-number.

- Products: a prompt such as ``"482*37"`` (3-digit times 2-digit). The tiny model cannot multiply, but it
  was pre-trained (``scripts/build_tiny_agent.py``) to call :func:`calculator` in the Hermes format now
  and then and to copy its result into the answer; otherwise it guesses. :func:`answer_reward` pays the
  exact product, so RL raises the share of trajectories that call the tool, and the reward with it.
- Dates: a prompt such as ``"1987-06-23"``, answered by its day of the week, which the tiny model cannot work
  out either: it calls :func:`weekday` now and then, else it guesses a day (right one time in seven).
- Conversions: a prompt such as ``"37 mi to km"`` (miles, inches, pounds and their metric units, either way),
  answered to two decimals ("59.55"), which the tiny model cannot work out: it calls :func:`convert` now and then,
  but then copies the result's whole part and guesses its decimals (right about one time in ten).
- Several at once (:func:`tool_prompts` with ``tools=[calculator, weekday]``, the task of model="tiny-agent" without
  data): the model was pre-trained with one, two or all three tools listed, in any order, so it picks the tool
  that the prompt needs by its name, and answers without a call when that tool is not listed.
- Guess-the-number (:class:`GuessNumber`): an environment without tools; each model turn is a guess,
  the environment answers "higher", "lower" or "correct" and pays 1 for the right number.
"""

from __future__ import annotations

import datetime
import operator
import random
import re
from typing import Any

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
GUESS_HIGH = 99
"""Guess-the-number's secret is a whole number in 1..GUESS_HIGH."""
GUESS_PROMPT = f"guess 1-{GUESS_HIGH}"
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
DATES = (datetime.date(1900, 1, 1), datetime.date(2099, 12, 31))
"""The first and last days of :func:`date_prompts`."""
UNITS = {"mi": ("km", 1.609344), "in": ("cm", 2.54), "lb": ("kg", 0.45359237)}
"""A unit of :func:`convert` -> its metric counterpart and how many of that one it is (exact by definition)."""


def calculator(expression: str) -> str:
    """Work out a whole-number arithmetic expression.

    Args:
        expression: two whole numbers joined by +, - or *, e.g. "482*37".
    """
    match = re.fullmatch(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*", expression)
    if match is None:
        raise ValueError(f"calculator takes two whole numbers joined by +, - or *, got {expression!r}")
    a, op, b = match.groups()
    return str(OPERATIONS[op](int(a), int(b)))


def weekday(date: str) -> str:
    """The day of the week of a date, in English.

    Args:
        date: a date written year-month-day, e.g. "2026-12-04".
    """
    try:
        day = datetime.date.fromisoformat(date.strip())
    except ValueError:
        raise ValueError(f"weekday takes a date written year-month-day such as 2026-12-04, got {date!r}") from None
    return WEEKDAYS[day.weekday()]


def convert(quantity: str) -> str:
    """Convert an amount between miles and km, inches and cm, or pounds and kg, to two decimals.

    Args:
        quantity: an amount, its unit and the unit wanted, e.g. "37 mi to km".
    """
    match = re.fullmatch(r"\s*(\d{1,9}(?:\.\d{1,9})?)\s*([a-z]+)\s+to\s+([a-z]+)\s*", quantity)
    factors = {**{(u, m): f for u, (m, f) in UNITS.items()}, **{(m, u): 1 / f for u, (m, f) in UNITS.items()}}
    if match is None or (match[2], match[3]) not in factors:
        pairs = ", ".join(f"{u} and {m}" for u, (m, _) in UNITS.items())
        raise ValueError(f'convert takes "<amount> <unit> to <unit>" for {pairs} (either way), got {quantity!r}')
    return f"{float(match[1]) * factors[match[2], match[3]]:.2f}"


TOOLS = (calculator, weekday, convert)
"""The tools model="tiny-agent" was pre-trained to call, each on its own task's prompts."""


def product_prompts(n: int, seed: int, *, digits: tuple[int, int] = (3, 2)) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": [user message "a*b"], "answer": "a*b"}``; ``a`` and ``b`` have ``digits`` digits."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        rows.append({"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)})
    return rows


def date_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": [user message "YYYY-MM-DD"], "answer": its weekday}``, days drawn from ``DATES``."""
    rng = random.Random(seed)
    first, last = (d.toordinal() for d in DATES)
    days = [datetime.date.fromordinal(rng.randint(first, last)) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": d.isoformat()}], "answer": WEEKDAYS[d.weekday()]} for d in days]


def conversion_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": [user message "<10..999> <unit> to <unit>"], "answer": its conversion}``, the units one
    of :data:`UNITS` and its metric counterpart, either way round."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        unit, metric = rng.choice([(u, m) for u, (m, _) in UNITS.items()])
        unit, to = (unit, metric) if rng.random() < 0.5 else (metric, unit)
        quantity = f"{rng.randint(10, 999)} {unit} to {to}"
        rows.append({"prompt": [{"role": "user", "content": quantity}], "answer": convert(quantity)})
    return rows


def tool_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of the two-tool task: products (:func:`product_prompts`, for :func:`calculator`) and dates
    (:func:`date_prompts`, for :func:`weekday`), each row either with probability 1/2."""
    rng = random.Random(seed)
    products = iter(product_prompts(n, rng.randrange(2**31)))
    dates = iter(date_prompts(n, rng.randrange(2**31)))
    return [next(products if rng.random() < 0.5 else dates) for _ in range(n)]


def answer_reward(prompts: list[Any], completions: list[str], *, answer: list[str], **fields: Any) -> list[float]:
    """1.0 where the final answer (the last model turn's text, stripped) is ``answer``, else 0.0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def guess_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": [user message "guess 1-99"], "secret": "<1..99>"}`` for :class:`GuessNumber`."""
    rng = random.Random(seed)
    return [
        {"prompt": [{"role": "user", "content": GUESS_PROMPT}], "secret": str(rng.randint(1, GUESS_HIGH))}
        for _ in range(n)
    ]


class GuessNumber:
    """Guess the secret number: each turn's first whole number is the guess; the reply is "higher" (the secret
    is larger), "lower" or "correct" (reward 1, done). A turn without a number gets "say a number"."""

    def reset(self, *, secret: str, **fields: Any) -> None:
        self.secret = int(secret)

    def step(self, text: str) -> tuple[str, float, bool]:
        found = re.search(r"\d+", text)
        if found is None:
            return "say a number", 0.0, False
        guess = int(found.group())
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False
