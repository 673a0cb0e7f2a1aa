"""An episode's environment around its turns, on the rollout's event loop (:class:`~rlkit.rollout.calls.CallRunner`):
made and reset (what reset returns is the first observation), and once the trajectory is over its reward asked
for (``get_reward``) and closed (``close``), each awaited when async."""

from __future__ import annotations

import logging
from typing import Any

from rlkit.data.envs import Environment, EnvironmentFactory, checked_observation
from rlkit.rollout.calls import call

logger = logging.getLogger(__name__)


async def fresh(factory: EnvironmentFactory, fields: dict[str, Any]) -> tuple[Environment, str | None]:
    """A new environment, reset with ``fields``, and what its reset returned (the first observation, or None)."""
    environment = await call(factory)
    return environment, checked_observation(await call(environment.reset, **fields))


async def final(environment: Environment, name: str) -> float | None:
    """``environment.get_reward()`` (None without one), then ``environment.close()``; a failed close is logged
    (the episode is over), naming the trajectory ``name``."""
    get_reward, close = getattr(environment, "get_reward", None), getattr(environment, "close", None)
    reward = await call(get_reward) if callable(get_reward) else None
    if callable(close):
        try:
            await call(close)
        except Exception as exc:  # noqa: BLE001 - the episode is over: a failed close is reported, not fatal
            logger.warning("%s: the environment's close failed: %s: %s", name, type(exc).__name__, exc)
    return reward
