"""Controller <-> worker machinery: ``launch`` workers, ``Cluster.run`` functions on them.

On a worker, inside a function given to ``run``, ``context()`` tells the rank, device and so on.
"""

from rlkit.runtime.cluster import Cluster, PerRank
from rlkit.runtime.context import WorkerContext, context
from rlkit.runtime.errors import ClusterBroken, RemoteError, WorkerDied, WorkerHung, WorkerOutOfMemory
from rlkit.runtime.launch import launch

__all__ = ["launch", "Cluster", "PerRank", "context", "WorkerContext", "RemoteError",
           "WorkerDied", "WorkerHung", "WorkerOutOfMemory", "ClusterBroken"]
