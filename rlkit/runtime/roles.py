"""Role instances on the workers, and the one way the controller calls their methods.

A role is a class whose instance lives on every rank between calls (the policy, the critic, the
reward model: see :mod:`rlkit.workers`). The controller builds it on all ranks with
:class:`RoleGroup` and calls a method by naming the method itself, so an editor's
jump-to-definition leads from the controller's call straight to the code the ranks run.

Example:
    policy = RoleGroup(cluster, PolicyWorker, config, model_dir)   # PolicyWorker(config, model_dir) on every rank
    results = policy.call(PolicyWorker.rollout, PerRank(prompts), seed=3)
    # results[r] is what rank r's PolicyWorker.rollout(prompts[r], seed=3) returned

Building a role again (a new ``RoleGroup`` of the same class, e.g. a new ``Trainer`` on the same
cluster) closes the previous instance first, so a rollout engine's processes never leak.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, TypeVar

from rlkit.runtime.context import context

if TYPE_CHECKING:
    from rlkit.runtime.cluster import Cluster

logger = logging.getLogger(__name__)

R = TypeVar("R", bound="Role")
T = TypeVar("T")


class Role:
    """Base of the classes :class:`RoleGroup` keeps on every rank; subclasses free what they own in :meth:`close`."""

    def setup_report(self) -> Any:
        """What the controller gets back once the instance is built (e.g. its device and memory)."""
        return None

    def close(self) -> None:
        """Free what this role holds beyond Python objects (engine processes, files); idempotent."""


class RoleGroup(Generic[R]):
    """One instance of ``role`` on every rank of ``cluster``, built with ``role(*args, **kwargs)`` there."""

    def __init__(self, cluster: Cluster, role: type[R], *args: Any, **kwargs: Any) -> None:
        if not (isinstance(role, type) and issubclass(role, Role)):
            raise TypeError(f"RoleGroup needs a subclass of rlkit.runtime.Role, got {role!r}")
        self.cluster = cluster
        self.role = role
        self.key = f"{role.__module__}.{role.__qualname__}"
        self.setup: list[Any] = cluster.run(_build, self.key, role, args, kwargs)
        """What each rank's instance reported once built (its ``setup_report()``)."""

    def call(self, method: Callable[Concatenate[R, ...], T], *args: Any, **kwargs: Any) -> list[T]:
        """``method(instance, *args, **kwargs)`` on every rank's instance; one result per rank, in rank order.

        ``method`` is the role's function itself (``PolicyWorker.update``); arguments wrapped in
        :class:`rlkit.runtime.PerRank` give each rank its own item, as in ``cluster.run``.
        """
        owner = method.__qualname__.rsplit(".", 1)[0]
        if not any(owner == cls.__qualname__ for cls in self.role.__mro__):
            raise TypeError(f"{method.__qualname__} is not a method of {self.role.__qualname__}")
        return self.cluster.run(_invoke, self.key, method, *args, **kwargs)


def local_instance(role: type[R]) -> R:
    """On a worker (inside a function given to ``cluster.run``): this rank's instance of ``role``.

    For probes and tests that look inside a role, e.g.
    ``cluster.run(lambda: local_instance(PolicyWorker).actor.lr)``.
    """
    key = f"{role.__module__}.{role.__qualname__}"
    instance = context().state.get(key)
    if not isinstance(instance, role):
        raise RuntimeError(f"no {role.__qualname__} on this rank: build it with RoleGroup(cluster, ...) first")
    return instance


def _build(key: str, role: type[Role], args: tuple, kwargs: dict[str, Any]) -> Any:
    """On a worker: close any earlier instance under ``key``, build the new one, return its setup report."""
    state = context().state
    previous = state.pop(key, None)
    if previous is not None:
        previous.close()
    instance = role(*args, **kwargs)
    state[key] = instance
    logger.info("%s ready", role.__qualname__)
    return instance.setup_report()


def _invoke(key: str, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """On a worker: the method on this rank's instance of the role."""
    instance = context().state.get(key)
    if instance is None:
        raise RuntimeError(f"no {key} on this rank: build it with RoleGroup(cluster, ...) first")
    return method(instance, *args, **kwargs)
