"""Controller <-> worker machinery: ``launch`` workers, ``Cluster.run`` functions on them.

On a worker, inside a function given to ``run``, ``context()`` tells the rank, device and so on.
``RoleGroup`` keeps one instance of a role class on every rank and calls its methods.
"""

from rlkit.runtime.cluster import Cluster, PerRank
from rlkit.runtime.context import WorkerContext, context
from rlkit.runtime.errors import ClusterBroken, RemoteError, RolesReplaced, WorkerDied, WorkerHung, WorkerOutOfMemory
from rlkit.runtime.launch import launch
from rlkit.runtime.roles import Role, RoleGroup, RoleOwner, local_instance

__all__ = ["launch", "Cluster", "PerRank", "Role", "RoleGroup", "RoleOwner", "context", "local_instance",
           "WorkerContext", "RemoteError", "WorkerDied", "WorkerHung", "WorkerOutOfMemory", "ClusterBroken",
           "RolesReplaced"]
