"""Role instances on the workers, and the one way the controller calls their methods.

A role is a class whose instance lives on every rank between calls (the policy, the critic, the
reward model: see :mod:`rlkit.workers`). The controller builds it on all ranks with
:class:`RoleGroup` and calls a method by naming the method itself, so an editor's
jump-to-definition leads from the controller's call straight to the code the ranks run.

Example:
    policy = RoleGroup(cluster, PolicyWorker, config, model_dir)   # PolicyWorker(config, model_dir) on every rank
    results = policy.call(PolicyWorker.rollout, PerRank(prompts), seed=3)
    # results[r] is what rank r's PolicyWorker.rollout(prompts[r], seed=3) returned

Roles have one owner at a time on a cluster (a :class:`RoleOwner`: one trainer). Building a role for a new
owner (a new ``Trainer`` on the same cluster, a re-run Trainer cell, ``Trainer.resume``) first closes every
role of the earlier owner on the ranks, so a rollout engine's processes and a critic's memory never linger;
a later call through the earlier owner's groups is refused (:class:`RolesReplaced`), naming the new owner,
instead of reaching the new owner's instances.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, TypeVar

from rlkit.runtime.context import context
from rlkit.runtime.errors import RolesReplaced

if TYPE_CHECKING:
    from rlkit.runtime.cluster import Cluster

logger = logging.getLogger(__name__)

R = TypeVar("R", bound="Role")
T = TypeVar("T")


class Role:
    """Base of the classes :class:`RoleGroup` keeps on every rank; subclasses free what they own in :meth:`close`."""

    owner_token = ""
    """The token of the :class:`RoleOwner` that built this instance (set on the rank when it is built)."""

    def setup_report(self) -> Any:
        """What the controller gets back once the instance is built (e.g. its device and memory)."""
        return None

    def close(self) -> None:
        """Free what this role holds beyond Python objects (engine processes, files); idempotent."""


class RoleOwner:
    """Who holds the roles on a cluster, e.g. one trainer; ``name`` says who in a refusal, ``hint`` what to do."""

    def __init__(self, name: str, hint: str = ""):
        self.name, self.hint = name, hint
        self.token = secrets.token_hex(8)

    def check(self, cluster: Cluster) -> None:
        """Raise :class:`RolesReplaced` unless this owner holds ``cluster``'s roles."""
        holder = _holders.get(cluster)
        if holder is not self:
            newer = "a later owner" if holder is None else holder.name
            raise RolesReplaced(f"{self.name} no longer holds its roles on this cluster: {newer} replaced them "
                                f"(one owner's models live on a cluster at a time). Use {newer}. {self.hint}".rstrip())

    def __repr__(self) -> str:
        return f"RoleOwner({self.name!r})"


_holders: weakref.WeakKeyDictionary[Cluster, RoleOwner] = weakref.WeakKeyDictionary()
"""Each cluster's current owner of roles (the one whose groups may call)."""


class RoleGroup(Generic[R]):
    """One instance of ``role`` on every rank of ``cluster``, built with ``role(*args, **kwargs)`` there.

    ``owner``: whose role it is (default: the group's own). Building it makes ``owner`` the cluster's holder,
    closing every other owner's roles on the ranks.
    """

    def __init__(self, cluster: Cluster, role: type[R], *args: Any, owner: RoleOwner | None = None,
                 **kwargs: Any) -> None:
        if not (isinstance(role, type) and issubclass(role, Role)):
            raise TypeError(f"RoleGroup needs a subclass of rlkit.runtime.Role, got {role!r}")
        self.cluster = cluster
        self.role = role
        self.owner = owner if owner is not None else RoleOwner(f"RoleGroup({role.__qualname__})")
        self.key = f"{role.__module__}.{role.__qualname__}"
        _holders[cluster] = self.owner  # first: a build that fails half-way leaves no earlier owner calling
        self.setup: list[Any] = cluster.run(_build, self.key, role, args, kwargs, self.owner.token)
        """What each rank's instance reported once built (its ``setup_report()``)."""

    def call(self, method: Callable[Concatenate[R, ...], T], *args: Any, **kwargs: Any) -> list[T]:
        """``method(instance, *args, **kwargs)`` on every rank's instance; one result per rank, in rank order.

        ``method`` is the role's function itself (``PolicyWorker.update``); arguments wrapped in
        :class:`rlkit.runtime.PerRank` give each rank its own item, as in ``cluster.run``.
        """
        defined_by = method.__qualname__.rsplit(".", 1)[0]
        if not any(defined_by == cls.__qualname__ for cls in self.role.__mro__):
            raise TypeError(f"{method.__qualname__} is not a method of {self.role.__qualname__}")
        self.owner.check(self.cluster)
        return self.cluster.run(MethodCall(self.key, method), *args, **kwargs)


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


def _build(key: str, role: type[Role], args: tuple, kwargs: dict[str, Any], owner_token: str) -> Any:
    """On a worker: close any earlier instance under ``key`` and every other owner's roles, build the new one,
    return its setup report."""
    state = context().state
    for name, previous in list(state.items()):
        if isinstance(previous, Role) and (name == key or previous.owner_token != owner_token):
            del state[name]
            previous.close()
    instance = role(*args, **kwargs)
    instance.owner_token = owner_token
    state[key] = instance
    logger.info("%s ready", role.__qualname__)
    return instance.setup_report()


class MethodCall:
    """What :meth:`RoleGroup.call` sends: on a worker, ``method`` on this rank's instance under ``key``.

    It carries the method's module and qualified name, so the cluster names the call after the
    role's method (``rlkit.workers.policy.PolicyWorker.update``) in hangs, deaths and out-of-memory
    reports: that is the phase that failed.
    """

    def __init__(self, key: str, method: Callable[..., Any]):
        self.key = key
        self.method = method
        self.__module__ = method.__module__
        self.__qualname__ = method.__qualname__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        instance = context().state.get(self.key)
        if instance is None:
            raise RuntimeError(f"no {self.key} on this rank: build it with RoleGroup(cluster, ...) first")
        return self.method(instance, *args, **kwargs)
