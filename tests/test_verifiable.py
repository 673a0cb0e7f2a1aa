"""Verifiable math rewards against hand-written cases, with and without math-verify, adversarial ones included."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlkit.data import verifiable
from rlkit.data.verifiable import (
    as_number,
    boxed_answers,
    final_answer,
    format_reward,
    math_reward,
    normalize_answer,
    reference_answer,
)

HAS_MATH_VERIFY = verifiable.math_verify_installed()


@pytest.fixture(params=["fallback", "math-verify"])
def engine(request, monkeypatch):
    """Run a test with the plain fallback, and again with math-verify where it is installed."""
    if request.param == "fallback":
        monkeypatch.setattr(verifiable, "math_verify_installed", lambda: False)
    elif not HAS_MATH_VERIFY:
        pytest.skip("math-verify is not installed (pip install 'rlkit[math]')")
    return request.param


def test_boxed_contents_keep_nested_braces():
    text = r"so \boxed{\frac{1}{2}} and \boxed{ {a}_{b} } then \fbox{7} and \boxed{unclosed"
    assert boxed_answers(text) == [r"\frac{1}{2}", "{a}_{b}", "7"]
    assert boxed_answers("no answer") == []


def test_final_answer_prefers_boxed_then_gsm8k_and_refuses_hedges():
    assert final_answer(r"#### 3 but really \boxed{4}") == "4"
    assert final_answer("Natalia sold 48 + 24 = 72 clips.\n#### 72") == "72"
    assert final_answer(r"\boxed{4} ... so \boxed{4.0}") == "4"  # agreeing answers count
    assert final_answer(r"either \boxed{3} or \boxed{4}") is None  # a hedge has no answer
    assert final_answer("") is None
    assert final_answer("####   ") is None
    assert final_answer("the answer is 42") is None  # a bare number is not a final answer


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("$1,234$", "1234"),
        (r"\$18.00", "18.00"),
        (r"5\text{ cm}", "5"),
        ("12 apples.", "12"),
        (r"\dfrac{3}{4}", "3/4"),
        (r"\frac12", "1/2"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        ("x = 7", "7"),
        (r"\left( 1, 2 \right)", "( 1, 2 )"),
        ("  Yes ", "yes"),
        (r"\text{(B)}", "(b)"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_as_number_is_exact():
    assert as_number("0.5") == as_number("1/2") == Fraction(1, 2)
    assert as_number("-3") == -3 and as_number(".25") == Fraction(1, 4)
    assert as_number("1/0") is None and as_number("2x") is None and as_number("1.2.3") is None


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        (r"The total is \boxed{1,234}.", "1234", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.50}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\$18}", "18", 1.0),
        (r"\boxed{5\text{ cm}}", "5", 1.0),
        ("She has 3 + 4 = 7.\n#### 7", "Janet has ... \n#### 7", 1.0),  # GSM8K reference solution
        (r"\boxed{72}", "He made 70 + 2 = 72\n#### 72", 1.0),
        (r"\boxed{71}", "#### 72", 0.0),
        (r"\boxed{3} or maybe \boxed{4}", "4", 0.0),  # hedging never pays
        ("", "4", 0.0),  # empty completion
        ("I am not sure.", "4", 0.0),  # no final answer
        (r"\boxed{4}", "4", 1.0),
    ],
)
def test_math_reward_hand_cases(engine, completion, answer, reward):
    assert math_reward(["What is it?"], [completion], answer=[answer]) == [reward]


def test_an_answer_only_in_the_prompt_does_not_count(engine):
    prompt = "Example: 2+2.\n#### 4\nNow: 1+3?"
    assert math_reward([prompt], ["I think the same as above."], answer=["4"]) == [0.0]
    assert math_reward([prompt], ["#### 4"], answer=["4"]) == [1.0]


def test_symbolic_equivalence_needs_math_verify(engine):
    got = math_reward([""], [r"\boxed{\frac{\sqrt{2}}{2}}"], answer=[r"\frac{1}{\sqrt{2}}"])
    assert got == ([1.0] if engine == "math-verify" else [0.0])


def test_reference_answer_reads_gsm8k_and_boxed_solutions():
    assert reference_answer("48/2 = 24\n#### 24") == "24"
    assert reference_answer(r"so $x=\boxed{3}$") == "3"
    assert reference_answer(" 42 ") == "42"


def test_format_reward_full_and_search():
    think = format_reward(r"<think>.+</think>\s*<answer>.+</answer>")  # the whole completion must match
    completions = ["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>",
                   "<think>x</think><answer>4</answer>?"]
    assert think([""] * 3, completions) == [1.0, 0.0, 0.0]
    boxed = format_reward(r"\\boxed\{", full=False)
    assert boxed([""] * 2, [r"so \boxed{1}", "1"]) == [1.0, 0.0]
