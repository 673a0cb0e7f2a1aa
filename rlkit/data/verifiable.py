"""Verifiable rewards: the final answer of a math completion against a reference, and a format reward.

Answers are read from the completion only (never the prompt): the contents of ``\\boxed{...}``
(nested braces allowed) or, without any, GSM8K's ``#### 42`` line. A completion with several
final answers counts only if they all agree; one that hedges (``\\boxed{3}`` ... ``\\boxed{4}``)
has no answer, so listing candidates never pays. Equivalence uses ``math-verify``
(``pip install 'rlkit[math]'``) where installed, after a plain numeric comparison that also
runs without it: numbers with thousands separators, units, ``%``, ``$``, ``\\frac``/``a/b``
fractions and decimals compare by exact value; anything else by its normalised text.

In TOML: ``[[rewards]] function = "rlkit.data.verifiable:math_reward"`` (reads the ``answer`` column).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Callable
from fractions import Fraction

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
GSM8K_MARK = re.compile(r"####\s*([^\n]*)")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\\mathrm|\\textbf|\\mbox")
_TEXT = re.compile(r"\\text\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)(\d)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*\s*=\s*")
_UNIT = re.compile(r"(?<=[\d.])\s*[a-zA-Z][a-zA-Z .]*$")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/[-+]?(\d+(\.\d*)?|\.\d+))?$")


def boxed_answers(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces kept; an
    unclosed one is skipped."""
    out = []
    for match in BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i].strip())
                break
    return out


def final_answer(completion: str) -> str | None:
    """The completion's final answer: its boxed answers if any, else its ``####`` answers; None when there
    is none, or when several disagree (a hedge)."""
    candidates = boxed_answers(completion) or [m.strip() for m in GSM8K_MARK.findall(completion) if m.strip()]
    if not candidates:
        return None
    first = candidates[0]
    return first if all(answers_equal(c, first) for c in candidates[1:]) else None


def reference_answer(answer: str) -> str:
    """A reference as datasets ship it: GSM8K's full solution ending in ``#### 72`` or a boxed solution
    (MATH) gives the answer in it; anything else is the answer itself."""
    if BOXED.search(answer) or GSM8K_MARK.search(answer):
        return final_answer(answer) or answer.strip()
    return answer.strip()


def answers_equal(predicted: str, reference: str) -> bool:
    """Whether two answers are the same: by value when both are numbers, else by ``math-verify`` (when
    installed), else by their normalised text."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    if a == b:
        return True
    return _math_verify(predicted, reference) if math_verify_installed() else False


def normalize_answer(answer: str) -> str:
    """The answer without math delimiters, spacing commands, ``\\text{}``, units after a number,
    ``%``, ``$``, degrees, thousands separators, a leading ``x =`` and a trailing period; ``\\frac{a}{b}``
    becomes ``a/b``. Case and inner spaces of text answers are folded."""
    s = answer.strip().strip("$").strip()
    s = s.removeprefix("\\(").removesuffix("\\)").removeprefix("\\[").removesuffix("\\]")
    s = _TEXT.sub(r"\1", _SPACING.sub("", s))
    s = _FRAC.sub(r"\1/\2", _FRAC_SHORT.sub(r"\1/\2", s))
    for mark in ("^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$", "°"):
        s = s.replace(mark, "")
    s = _THOUSANDS.sub("", _ASSIGNMENT.sub("", s.strip())).rstrip(".").strip()
    s = _UNIT.sub("", s) if as_number(_UNIT.sub("", s)) is not None else s
    return " ".join(s.lower().split())


def as_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal or ``a/b`` fraction (``"3"``, ``"-0.5"``, ``"1/2"``), else None."""
    s = text.replace(" ", "")
    if not _NUMBER.match(s):
        return None
    try:
        return Fraction(s) if "/" not in s else Fraction(s.split("/")[0]) / Fraction(s.split("/")[1])
    except ZeroDivisionError:
        return None


def math_reward(prompts: list[str], completions: list[str], *, answer: list[str], **fields: object) -> list[float]:
    """1.0 where the completion's :func:`final_answer` equals the reference ``answer`` column, else 0.0.

    An empty completion, one without a final answer and one that hedges between answers score 0.
    """
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        predicted = final_answer(completion)
        out.append(float(predicted is not None and answers_equal(predicted, reference_answer(str(ref)))))
    return out


def format_reward(pattern: str, *, full: bool = True, flags: int = re.DOTALL) -> Callable[..., list[float]]:
    """A reward giving 1.0 to completions that match the regex ``pattern`` (the whole completion, stripped,
    with ``full``; anywhere in it otherwise), else 0.0.

    Made in a reward file and named in TOML: ``think = format_reward(r"<think>.+</think>.+")`` then
    ``[[rewards]] function = "my_rewards.py:think"``.
    """
    regex = re.compile(pattern, flags)
    match = regex.fullmatch if full else regex.search

    def format_match(prompts: list[str], completions: list[str], **fields: object) -> list[float]:
        return [float(match(c.strip()) is not None) for c in completions]

    return format_match


def math_verify_installed() -> bool:
    """Whether ``math-verify`` can be imported (``pip install 'rlkit[math]'``)."""
    return importlib.util.find_spec("math_verify") is not None


def _math_verify(predicted: str, reference: str) -> bool:
    """math-verify's symbolic equivalence of two answers (its time limit works in the main thread only)."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
    guess = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=timeout))
