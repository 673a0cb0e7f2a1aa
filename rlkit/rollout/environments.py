"""An episode's environment around its turns, on the rollout's event loop (:class:`~rlkit.rollout.calls.CallRunner`):
made and reset (what reset returns is the first observation); once the trajectory is over, its reward asked for
(``get_reward``), and, whatever failed before, closed (``close``); each awaited when async."""

from __future__ import annotations

import math
import numbers
from typing import Any

from rlkit.data.envs import Environment, EnvironmentFactory, checked_observation
from rlkit.rollout.calls import call


async def fresh(factory: EnvironmentFactory, fields: dict[str, Any], made: list[Environment]) -> str | None:
    """What a new environment's reset with ``fields`` returned (the first observation, or None); the environment is
    appended to ``made`` as soon as it exists, so that it is closed even when its reset fails or times out."""
    environment = await call(factory)
    made.append(environment)
    return checked_observation(await call(environment.reset, **fields))


async def reward(environment: Environment) -> float | None:
    """``environment.get_reward()``, checked (None without one). Raises TypeError unless it is a finite number."""
    get_reward = getattr(environment, "get_reward", None)
    if not callable(get_reward):
        return None
    value = await call(get_reward)
    if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value)):
        raise TypeError(f"get_reward returned {value!r:.60} ({type(value).__name__}): return a finite number, or None")
    return None if value is None else float(value)


async def closed(environment: Environment) -> None:
    """``environment.close()``, when it has one."""
    close = getattr(environment, "close", None)
    if callable(close):
        await call(close)
