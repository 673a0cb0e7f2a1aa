"""``launch()``: start a cluster of workers; the registry of live clusters; the exit hook."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import tempfile
import weakref
from pathlib import Path

from rlkit.runtime.cluster import Backend, Cluster
from rlkit.runtime.local import DEVICES

logger = logging.getLogger(__name__)

BACKENDS = ("local", "ray")
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_HANG_TIMEOUT_S = 120.0

# Clusters launched by this process. Re-running a notebook's launch cell rebinds the variable,
# but the old cluster often stays reachable (Out[n], a trainer that holds it) with its workers
# holding memory (GPU memory on a GPU machine), so launch() shuts every earlier cluster down
# first, and _shutdown_all() does at interpreter exit. The references are weak so that the
# registry never keeps a dropped cluster alive: a garbage-collected cluster stops its own workers.
_live_clusters: weakref.WeakSet[Cluster] = weakref.WeakSet()


def launch(world_size: int = 2, *, backend: str = "local", device: str = "auto",
           address: str | None = None, timeout: float | None = None,
           hang_timeout: float = DEFAULT_HANG_TIMEOUT_S, call_timeout: float | None = None,
           log_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None,
           verbose: bool = False) -> Cluster:
    """Start ``world_size`` workers and return the ``Cluster``. Earlier clusters of this process
    are shut down first.

    backend: "local" (fresh processes on this machine) or "ray" (Ray actors in a placement
    group, one bundle per rank; needs ``pip install 'rlkit[ray]'``).
    device: "auto" (CUDA if the workers see one GPU per rank; the controller never touches
    CUDA), "cpu" or "cuda".
    address: Ray only: None or "auto" (join the Ray cluster this machine belongs to, or start a
    local one bound to loopback), or "ray://HOST:PORT" (Ray client). Ignored if Ray is already
    initialised in this process.
    timeout: seconds to wait for the workers to start (default 120).
    hang_timeout: seconds a rank may keep running a call after another rank finished it before
    the call is declared hung (default 120; raise it for calls where one rank does long extra
    work, like saving on rank 0). call_timeout: seconds any one call may take (default: no
    limit). Both are attributes of the cluster that can be changed later.
    log_dir: where ``rank<N>.log`` files go (default: a fresh temporary directory, removed at a
    clean shutdown and kept, named in the log, when a call failed or a rank died or hung).
    env: extra environment variables for the workers (e.g. ``{"OMP_NUM_THREADS": "4"}``; the
    default gives each local rank an equal share of the cores). The local backend sets the
    torch.distributed variables itself, and GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the loopback
    interface (nothing of it listens beyond loopback); ``env`` cannot change those.
    verbose: forward every line the workers print; False (default) keeps vLLM's own log lines
    (its start-up banner, the weight loader's per-sync messages) in the rank logs only.

    Example:
        >>> import os, rlkit
        >>> cluster = rlkit.launch(world_size=2)
        >>> pids = cluster.run(os.getpid)          # one result per rank
        >>> len(set(pids)), os.getpid() in pids    # two fresh processes, neither of them this one
        (2, False)
        >>> cluster.shutdown()
    """
    _check(world_size, backend, device, address, timeout, hang_timeout, call_timeout, env)
    _shutdown_all()
    start_timeout = DEFAULT_START_TIMEOUT_S if timeout is None else timeout

    def make_backend(cluster_id: str) -> Backend:
        logs = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"rlkit-{cluster_id}-logs-"))
        logs.mkdir(parents=True, exist_ok=True)
        if backend == "ray":
            from rlkit.runtime.ray_backend import RayBackend

            return RayBackend(world_size, cluster_id=cluster_id, device=device, address=address,
                              timeout=start_timeout, log_dir=logs, env=env)
        from rlkit.runtime.local_backend import LocalBackend

        return LocalBackend(world_size, cluster_id=cluster_id, device=device,
                            timeout=start_timeout, log_dir=logs, env=env)

    cluster = Cluster(make_backend, hang_timeout=hang_timeout, call_timeout=call_timeout, verbose=verbose,
                      owns_log_dir=log_dir is None)
    _live_clusters.add(cluster)
    logger.info("launched %r", cluster)
    return cluster


def _check(world_size: int, backend: str, device: str, address: str | None,
           timeout: float | None, hang_timeout: float, call_timeout: float | None,
           env: dict[str, str] | None) -> None:
    """Raise one ValueError listing every bad argument."""
    problems = []
    if backend not in BACKENDS:
        problems.append(f"backend={backend!r}: valid backends are {', '.join(map(repr, BACKENDS))}")
    elif backend == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("backend='ray' needs Ray: pip install 'rlkit[ray]'")
    if device not in DEVICES:
        problems.append(f"device={device!r}: valid devices are {', '.join(map(repr, DEVICES))}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size must be a positive int, got {world_size!r}")
    if address is not None and backend != "ray":
        problems.append(f"address={address!r} is for backend='ray'; the local backend needs none")
    for name, value in (("timeout", timeout), ("hang_timeout", hang_timeout),
                        ("call_timeout", call_timeout)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            problems.append(f"{name} must be positive seconds, got {value!r}")
    bad_env = [k for k, v in (env or {}).items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad_env:
        problems.append(f"env keys and values must be strings; not so for {bad_env}")
    if problems:
        raise ValueError("rlkit.launch: " + "; ".join(problems))


@atexit.register
def _shutdown_all() -> None:
    """Shut down every live cluster of this process."""
    for cluster in list(_live_clusters):
        if not cluster.closed:
            logger.info("shutting down cluster %s", cluster.id)
            cluster.shutdown()
