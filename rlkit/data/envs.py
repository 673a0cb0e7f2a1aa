"""Environments: plain Python objects a model plays turns against, one per trajectory.

An environment has ``reset(**fields)`` (the prompt row's fields, e.g. ``secret=...``; it may return the first
observation, a str the model reads as a user message after the prompt, or None) and either
``step(text) -> (observation, reward, done)`` or tools:

- ``step``: ``text`` is the model's turn (special tokens dropped), ``observation`` the reply the model reads
  next (a user message), ``reward`` this turn's reward and ``done`` whether the episode is over.
- tools (TRL's ``environment_factory``): a class without ``step`` offers its public methods (type hints and an
  ``Args:`` docstring, as tool functions) as tools; each trajectory calls its own instance, so a tool can keep
  a sandbox, a browser page or a game's state. The episode ends when the model answers without a call.

Optionally ``get_reward()``, called once the trajectory is over (its value joins the last turn's reward), and
``close()``, called after it, to release what ``reset`` opened: every environment made is closed exactly once,
whatever failed (its reset, a step, a tool, ``get_reward``, a timeout), so ``close`` must cope with a half-done
``reset``; a failing ``close`` is logged and recorded on the trajectory, never raised. Any of them may be
``async``: a worker runs all of them on one event loop (:class:`rlkit.rollout.calls.CallRunner`), so a subprocess
or client opened in ``reset`` can be used in every ``step`` or tool call and ended in ``close``. The run is given
the class (or any callable that makes a fresh one; only a class can offer tools); each trajectory gets its own
instance, so no state is shared.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Environment(Protocol):
    """``reset`` and ``step`` (each may be async); ``close`` is optional."""

    def reset(self, **fields: Any) -> Any: ...

    def step(self, text: str) -> Any: ...


EnvironmentFactory = Callable[[], Environment]
"""A class or a function returning a fresh environment."""


class EnvStep(NamedTuple):
    """What an environment's step returned, checked."""

    observation: str
    reward: float
    done: bool


RESERVED = ("reset", "step", "close", "get_reward")
"""An environment's methods that are never tools."""


def tool_methods(cls: type) -> list[Callable[..., Any]]:
    """The methods of an environment class without ``step`` that are its tools: the public ones it defines or
    inherits (not ``reset``, ``close``, ``get_reward``), in the order they are defined; none for a class with
    ``step``."""
    if callable(getattr(cls, "step", None)):
        return []
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object's last: a subclass's definition wins
        members.update(vars(klass))
    return [m for name, m in members.items() if inspect.isfunction(m) and not name.startswith("_") and name not in
            RESERVED]  # fmt: skip


def environment_problems(factory: Any) -> list[str]:
    """Why ``factory`` cannot make environments: not callable, or (a class) without ``reset``, or without both
    ``step`` and tool methods."""
    if not callable(factory):
        return [f"environment is a {type(factory).__name__}: give a class (or a function returning an instance)"]
    if not inspect.isclass(factory):
        return []
    acts = callable(getattr(factory, "step", None)) or bool(tool_methods(factory))
    if not (callable(getattr(factory, "reset", None)) and acts):
        return [
            f"environment {factory.__qualname__} needs reset(self, **fields), and step(self, text) -> (observation, "
            "reward, done) or public methods the model calls as tools (with type hints and an Args: docstring)"
        ]
    return []


def reset_problems(factory: EnvironmentFactory, fields: dict[str, Any], timeout: float) -> list[str]:
    """Why ``factory`` cannot start an episode on a row of the data: an environment made, reset with the row's
    ``fields`` and closed, even after a failed reset (in an event loop of its own, on a thread of its own), within
    ``timeout`` seconds; a failing close is a problem too, after the reset's."""
    name = getattr(factory, "__qualname__", None) or repr(factory)
    found: list[list[str]] = []
    thread = threading.Thread(target=lambda: found.append(_trial(factory, fields, name)), daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return [f"environment {name}: reset(**fields) on the data's first row took longer than agent.call_timeout="
                f"{timeout:g} s: make it faster, or raise the timeout"]  # fmt: skip
    return found[0]


def _trial(factory: EnvironmentFactory, fields: dict[str, Any], name: str) -> list[str]:
    """The problems of making, resetting and closing one environment, in one event loop."""
    return asyncio.run(_made_reset_closed(factory, fields, name))


async def _made_reset_closed(factory: EnvironmentFactory, fields: dict[str, Any], name: str) -> list[str]:
    try:
        environment = await _resolved(factory)
    except Exception as exc:  # noqa: BLE001 - the user's code failing is the problem reported
        return [f"environment {name}: making one raised {type(exc).__name__}: {exc}; `environment` names a "
                "class with reset(self, **fields) and step(self, text), or a function of no arguments returning "
                "one"]  # fmt: skip
    if not callable(getattr(environment, "reset", None)):
        return [f"environment {name}: what it makes ({type(environment).__name__}) has no reset method"]
    problems = []
    try:
        checked_observation(await _resolved(environment.reset, **fields))
    except BaseException as exc:  # noqa: BLE001 - the user's code failing (SystemExit too) is the problem reported
        problems.append(f"environment {name}: reset(**fields) on the data's first row raised {type(exc).__name__}: "
                        f"{exc}; the rows have the fields {sorted(fields)}")  # fmt: skip
    close = getattr(environment, "close", None)
    try:
        if callable(close):
            await _resolved(close)
    except BaseException as exc:  # noqa: BLE001 - the user's code failing (SystemExit too) is the problem reported
        problems.append(f"environment {name}: close() after a reset on the data's first row raised "
                        f"{type(exc).__name__}: {exc}; close must release what reset opened, even after a failed "
                        "reset")  # fmt: skip
    return problems


async def _resolved(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    value = fn(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


def checked_observation(value: Any) -> str | None:
    """What an environment's reset returned, checked (the first observation, or None): raises TypeError naming what
    is wrong."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"reset returned {value!r:.60} ({type(value).__name__}): return the first observation as a "
                        "str, or None")  # fmt: skip
    return value


def checked_step(value: Any) -> EnvStep:
    """What an environment's step returned, checked: raises TypeError naming what is wrong."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"step returned {value!r:.100}; expected (observation: str, reward: float, done: bool)")
    observation, reward, done = value
    if not isinstance(observation, str):
        raise TypeError(f"step returned the observation {observation!r:.60} ({type(observation).__name__}), not a str")
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"step returned the reward {reward!r}: expected a finite number")
    return EnvStep(observation, float(reward), bool(done))
