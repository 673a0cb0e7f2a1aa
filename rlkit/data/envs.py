"""Environments: plain Python objects a model plays turns against, one per trajectory.

An environment has ``reset(**fields)`` (the prompt row's fields, e.g. ``secret=...``; its return value
is ignored) and ``step(text) -> (observation, reward, done)``: ``text`` is the model's turn (special tokens
dropped), ``observation`` the reply the model reads next (a user message), ``reward`` this turn's reward and
``done`` whether the episode is over. Either method may be ``async``. The run is given the class (or any
callable that makes a fresh one); each trajectory gets its own instance, so no state is shared.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Environment(Protocol):
    def reset(self, **fields: Any) -> Any: ...

    def step(self, text: str) -> Any: ...


EnvironmentFactory = Callable[[], Environment]
"""A class or a function returning a fresh environment."""


class EnvStep(NamedTuple):
    """What an environment's step returned, checked."""

    observation: str
    reward: float
    done: bool


def environment_problems(factory: Any) -> list[str]:
    """Why ``factory`` cannot make environments: not callable, or (a class) without ``reset`` and ``step``."""
    if not callable(factory):
        return [f"environment is a {type(factory).__name__}: give a class (or a function returning an instance)"]
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            return [
                f"environment {factory.__qualname__} has no {' and no '.join(missing)} method: give it "
                "reset(self, **fields) and step(self, text) -> (observation, reward, done)"
            ]
    return []


def finish(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (an async method's coroutine), run to completion in
    a fresh event loop of this thread."""
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(value: Any) -> Any:
    return await value


def env_step(environment: Environment, text: str) -> EnvStep:
    """``environment.step(text)``, awaited when async, checked: raises TypeError naming what is wrong."""
    value = finish(environment.step(text))
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"step returned {value!r:.100}; expected (observation: str, reward: float, done: bool)")
    observation, reward, done = value
    if not isinstance(observation, str):
        raise TypeError(f"step returned the observation {observation!r:.60} ({type(observation).__name__}), not a str")
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"step returned the reward {reward!r}: expected a finite number")
    return EnvStep(observation, float(reward), bool(done))
