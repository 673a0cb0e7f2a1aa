"""``launch()``: start a cluster of workers; the registry of live clusters; the exit hook."""

from __future__ import annotations

import atexit
import logging
import os
import weakref

from rlkit.runtime.cluster import Cluster
from rlkit.runtime.local import DEVICES

logger = logging.getLogger(__name__)

BACKENDS = ("local",)
DEFAULT_START_TIMEOUT_S = 120.0

# Clusters launched by this process. Re-running a notebook's launch cell rebinds the variable,
# but the old cluster often stays reachable (Out[n], a trainer that holds it) with its workers
# holding memory (GPU memory on a GPU machine), so launch() shuts every earlier cluster down
# first, and _shutdown_all() does at interpreter exit. The references are weak so that the
# registry never keeps a dropped cluster alive: a garbage-collected cluster stops its own workers.
_live_clusters: weakref.WeakSet[Cluster] = weakref.WeakSet()


def launch(world_size: int = 2, *, backend: str = "local", device: str = "auto",
           timeout: float | None = None, log_dir: str | os.PathLike | None = None,
           env: dict[str, str] | None = None) -> Cluster:
    """Start ``world_size`` workers in fresh background processes and return the ``Cluster``.

    backend: "local" (processes on this machine). device: "auto" (CUDA if the workers see
    enough GPUs, one per rank; the controller itself never touches CUDA), "cpu" or "cuda".
    timeout: seconds to wait for the workers to start (default 120). log_dir: where
    ``rank<N>.log`` files go (default: a fresh temporary directory). env: extra environment
    variables for the workers (e.g. ``{"OMP_NUM_THREADS": "4"}``; the default gives each rank an
    equal share of the cores). Earlier clusters of this process are shut down first.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; valid backends: "
                         f"{', '.join(map(repr, BACKENDS))} (the 'ray' backend is not implemented yet)")
    if device not in DEVICES:
        raise ValueError(f"device={device!r}; valid devices: {', '.join(map(repr, DEVICES))}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    bad_env = [k for k, v in (env or {}).items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad_env:
        raise ValueError(f"env keys and values must be strings; not so for {bad_env}")
    _shutdown_all()
    cluster = Cluster(world_size, device=device,
                      timeout=DEFAULT_START_TIMEOUT_S if timeout is None else timeout,
                      log_dir=log_dir, env=env)
    _live_clusters.add(cluster)
    logger.info("launched %r", cluster)
    return cluster


@atexit.register
def _shutdown_all() -> None:
    """Shut down every live cluster of this process."""
    for cluster in list(_live_clusters):
        if not cluster.closed:
            logger.info("shutting down cluster %s", cluster.id)
            cluster.shutdown()
