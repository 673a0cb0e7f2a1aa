"""Synthetic verifiable tasks and their rewards."""

from __future__ import annotations

import random
from dataclasses import dataclass

EOS_TEXT = "<|endoftext|>"
"""End-of-text marker of the bundled tiny tokenizer; a completion ends at its first occurrence."""


@dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """Addition of two non-negative integers.

    A prompt is raw text (no chat template) such as ``"17+25="``; the expected
    completion is the decimal sum without spaces or leading zeros, ``"42"``,
    followed by the end-of-text token. Rows are ``{"prompt": ..., "answer": ...}``;
    ``answer`` is passed to `addition_reward` as a keyword field.
    """

    max_operand: int = 99
    """Largest operand; both operands are drawn uniformly from ``0..max_operand``."""

    def __post_init__(self) -> None:
        if self.max_operand < 0:
            raise ValueError(f"max_operand must be >= 0, got {self.max_operand}")

    def sample(self, n: int, rng: random.Random) -> list[dict[str, str]]:
        """``n`` prompts as ``{"prompt": "a+b=", "answer": "a+b"}``, drawn from ``rng``."""
        rows = []
        for _ in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        return rows


def addition_reward(
    prompts: list[str], completions: list[str], *, answer: list[str], **fields: object
) -> list[float]:
    """1.0 where the completion equals the answer, else 0.0.

    The completion is compared after cutting it at the first ``EOS_TEXT`` and
    stripping surrounding whitespace. ``prompts``, ``completions`` and ``answer``
    must have the same length; other row fields are ignored.
    """
    if not len(prompts) == len(completions) == len(answer):
        raise ValueError(
            f"length mismatch: {len(prompts)} prompts, {len(completions)} completions, "
            f"{len(answer)} answers"
        )
    return [
        float(completion.split(EOS_TEXT, 1)[0].strip() == expected.strip())
        for completion, expected in zip(completions, answer, strict=True)
    ]
