"""Prompt sources: a list of prompts, shuffled per epoch in a seeded order, or the bundled task's generator."""

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
    accepted and become ``{"prompt": s}``. A list is shuffled once per pass (epoch),
    in an order fixed by the seed and the epoch, so a resumed source serves the same
    prompts as one that never stopped. ``add_special_tokens`` says how to tokenize the
    prompts: False when they were rendered by a chat template (which writes its own BOS).
    """

    def __init__(
        self,
        items: Sequence[str | dict[str, Any]] | None = None,
        *,
        task: Task | None = None,
        seed: int = 0,
        add_special_tokens: bool = True,
    ):
        if (items is None) == (task is None):
            raise ValueError("give exactly one of items (a list of prompts) or task")
        self._items = _normalise(items) if items is not None else None
        self._task = task
        self._seed = seed
        self._served = 0
        self._order: tuple[int, list[int]] = (-1, [])
        self.add_special_tokens = add_special_tokens

    @property
    def items(self) -> list[dict[str, Any]]:
        """Every item in its given order (a validation set is read this way); not for a task source."""
        if self._items is None:
            raise TypeError("a task source generates prompts: it has no fixed list of items")
        return list(self._items)

    def next(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` items."""
        if self._task is not None:
            out = self._task.sample(n, random.Random(f"{self._seed}:{self._served}"))
        else:
            out = [self._item(self._served + i) for i in range(n)]
        self._served += n
        return out

    def _item(self, index: int) -> dict[str, Any]:
        assert self._items is not None
        epoch, offset = divmod(index, len(self._items))
        if self._order[0] != epoch:
            order = list(range(len(self._items)))
            random.Random(f"{self._seed}:epoch{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._items[self._order[1][offset]]

    def state_dict(self) -> dict[str, int]:
        """The position: prompts served so far, the seed and the number of items (checked on load)."""
        size = len(self._items) if self._items is not None else 0
        return {"served": self._served, "seed": self._seed, "size": size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; raises ValueError if it was saved for a different number of items."""
        size = len(self._items) if self._items is not None else 0
        if state.get("size", size) != size:
            raise ValueError(
                f"the saved prompt position is for {state['size']} prompts but this source has {size}: "
                "resume with the same data (files, filters and max_prompt_tokens) as the saved run"
            )
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
