"""Prompt sources: a user's list, cycled in a seeded order, or the bundled task's generator."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol


class Task(Protocol):
    def sample(self, n: int, rng: random.Random) -> list[dict[str, str]]: ...


class PromptSource:
    """Hands out prompts step by step, reproducibly for a seed, with a resumable position.

    Items are dicts with a non-empty "prompt" string; their other keys travel to
    reward functions as keyword arguments (e.g. ``answer``). Plain strings are
    accepted and become ``{"prompt": s}``. A list is shuffled once per pass.
    """

    def __init__(self, items: Sequence[str | dict[str, Any]] | None = None, *, task: Task | None = None, seed: int = 0):
        if (items is None) == (task is None):
            raise ValueError("give exactly one of items (a list of prompts) or task")
        self._items = _normalise(items) if items is not None else None
        self._task = task
        self._seed = seed
        self._served = 0

    @property
    def field_names(self) -> list[str]:
        """The extra keys each item carries besides "prompt"."""
        first = self._items[0] if self._items is not None else self._task.sample(1, random.Random(0))[0]
        return [k for k in first if k != "prompt"]

    def next(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` items."""
        if self._task is not None:
            out = self._task.sample(n, random.Random(f"{self._seed}:{self._served}"))
        else:
            out = [self._item(self._served + i) for i in range(n)]
        self._served += n
        return out

    def _item(self, index: int) -> dict[str, Any]:
        epoch, offset = divmod(index, len(self._items))
        order = list(range(len(self._items)))
        random.Random(f"{self._seed}:epoch{epoch}").shuffle(order)
        return self._items[order[offset]]

    def state_dict(self) -> dict[str, int]:
        return {"served": self._served, "seed": self._seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._served = state["served"]
        self._seed = state["seed"]


def _normalise(items: Sequence[str | dict[str, Any]]) -> list[dict[str, Any]]:
    if len(items) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out, problems = [], []
    for i, item in enumerate(items):
        row = {"prompt": item} if isinstance(item, str) else dict(item)
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            problems.append(f"prompts[{i}]: the prompt must be a non-empty string, got {text!r}")
        out.append(row)
    keys = {frozenset(r) for r in out}
    if len(keys) > 1:
        problems.append(f"prompts carry different keys {sorted(map(sorted, keys))}: every item needs the same fields")
    if problems:
        raise ValueError("bad prompts:\n" + "\n".join(f"  - {p}" for p in problems))
    return out
