"""Running under torchrun, for clusters without Ray (SLURM, plain torchrun): every process is a rank.

    torchrun --standalone --nproc_per_node=2 -m rlkit train CONFIG
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m rlkit train CONFIG

Rank 0 is also the controller: :func:`run_controller` runs the controller in a thread while the process's
main thread serves rank 0's calls; every other rank only serves (:func:`serve`). Calls travel through
``Cluster`` and :class:`~rlkit.runtime.torchrun_backend.TorchrunBackend` exactly as with the other
backends, and each rank runs them with its ``WorkerCore`` on its main thread, so cancelling, hang
reports and out-of-memory reports work as there.

Messages go through torchrun's store (which rlkit reuses, under its own prefix); tensors through
shared-memory files for the ranks on rank 0's machine, and through the store for the others
(:mod:`rlkit.runtime.torchrun_backend`).

What is torchrun's business: the rendezvous and its store, starting and stopping the processes,
restarting them (rlkit does not resume by itself: use checkpoints), and each rank's output (the
terminal, or ``--log-dir``; worker log lines carry ``[rank N]``). When all ranks are on one node,
gloo's and NCCL's sockets are put on the loopback interface (unless GLOO_SOCKET_IFNAME or
NCCL_SOCKET_IFNAME is set), so rlkit opens nothing beyond loopback; torchrun's store listens where
torchrun puts it, without a secret, so rlkit signs every message it puts there and refuses any that is not
signed (:mod:`rlkit.runtime.store_channel`; across nodes, set ``RLKIT_TORCHRUN_SECRET`` on every node).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist

from rlkit.runtime import store_channel, transport
from rlkit.runtime.cluster import Cluster
from rlkit.runtime.core import LoadedCall, WorkerCore, error_info, rss_mb
from rlkit.runtime.launch import DEFAULT_HANG_TIMEOUT_S, DEFAULT_START_TIMEOUT_S
from rlkit.runtime.local import loopback_interface
from rlkit.runtime.torchrun_backend import TorchrunBackend
from rlkit.runtime.worker import HEARTBEAT_S, close_state, configure_logging

logger = logging.getLogger(__name__)

T = TypeVar("T")
CONTROL_EVERY_S = 0.1
"""How often a rank's control thread looks for a cancel or stacks request."""
EXIT_GRACE_S = 30.0
"""How long rank 0 waits, once the controller is done, for its own worker to leave (closing engines)."""


def launched() -> bool:
    """True in a process that torchrun started (it sets TORCHELASTIC_RUN_ID beside RANK, WORLD_SIZE, ...)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def rank() -> int:
    return int(os.environ["RANK"])


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def node_of_ranks() -> list[int]:
    """The node of every rank: torchrun gives each node LOCAL_WORLD_SIZE consecutive ranks."""
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    return [r // per_node for r in range(world_size())]


def run_controller(
    main: Callable[[Cluster], T],
    *,
    device: str = "auto",
    timeout: float = DEFAULT_START_TIMEOUT_S,
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S,
    call_timeout: float | None = None,
) -> T:
    """On rank 0, from the main thread: ``main(cluster)`` in a thread, on a ``Cluster`` of every rank, while
    the main thread serves rank 0's calls. Returns what ``main`` returned (or raises what it raised) once every
    rank has been told to leave. ``device``, ``timeout``, ``hang_timeout`` and ``call_timeout`` are
    ``rlkit.launch``'s. If rank 0's own worker is still stuck in a call ``EXIT_GRACE_S`` after ``main`` ended,
    the process exits with code 1 (torchrun then stops the other ranks).
    """
    outcome: dict[str, Any] = {}
    served = threading.Event()

    def control() -> None:
        try:
            backend = partial(TorchrunBackend, device=device, timeout=timeout)
            with Cluster(lambda cid: backend(cluster_id=cid), hang_timeout=hang_timeout,
                         call_timeout=call_timeout) as cluster:  # fmt: skip
                outcome["value"] = main(cluster)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = exc
        if not served.wait(EXIT_GRACE_S):
            logger.error("rank 0's worker is still in a call %g s after the controller finished; exiting",
                         EXIT_GRACE_S, exc_info=outcome.get("error"))  # fmt: skip
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    thread = threading.Thread(target=control, name="rlkit-controller", daemon=True)
    thread.start()
    try:
        serve()
    finally:
        served.set()
    thread.join()
    if not os.environ.get(store_channel.SECRET_VARIABLE):  # every rank was told to leave: no one reads it again
        store_channel.secret_file().unlink(missing_ok=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def serve() -> int:
    """This rank's worker: join the process group when the controller says so, run its calls on this
    (main) thread until it says "shutdown"; returns the process's exit code (1: it could not join)."""
    me = rank()
    configure_logging(me, prefix=f"[rank {me}] ")
    store = store_channel.connect()
    core = WorkerCore(me)
    inbox = _Inbox(store, me)
    msg = inbox.next()
    if msg[0] != "init":  # stopped before start-up finished
        return 0
    config = msg[1]
    try:
        ctx = core.join({"device": config["device"], "sys_path": list(sys.path), "env": _socket_env()})
    except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
        store_channel.put_object(store, f"ready/{me}", ("failed", error_info(exc)))
        return 1
    shm_prefix = config["shm_prefix"] if shares_memory(config["probe"]) else None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "device": str(ctx.device),
            "shares_memory": shm_prefix is not None}  # fmt: skip
    store_channel.put_object(store, f"ready/{me}", ("ready", info))
    stop = threading.Event()
    control = threading.Thread(target=_control, args=(core, stop), name="rlkit-control", daemon=True)
    control.start()
    while (msg := inbox.next())[0] == "call":
        _, call_id, data, keys = msg
        ok, reply = core.execute(call_id, partial(_load, store, data, keys), partial(_dump, shm_prefix))
        parts = [pickle.dumps((True, reply[0])), *reply[1]] if ok else [pickle.dumps((False, reply))]
        store_channel.put(store, f"out/{me}/{call_id}", parts)
        store.add(f"done/{call_id}", 1)
    stop.set()
    control.join()  # no thread may be inside a store request when the interpreter exits
    close_state(ctx)
    dist.destroy_process_group()
    return 0


class _Inbox:
    """The messages to one rank's main loop, in order (each is deleted once read)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store, self._rank, self._next = store, rank, 0

    def next(self) -> tuple:
        key = f"in/{self._rank}/{self._next}"
        self._next += 1
        return store_channel.get_object(self._store, key, delete=True)  # blocks until it is there


def _socket_env() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME on the loopback interface when every rank is on this node
    (and the user set neither)."""
    if world_size() != int(os.environ["LOCAL_WORLD_SIZE"]):
        return {}
    interface = loopback_interface()
    return {name: interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in os.environ}


def _load(store: dist.Store, data: bytes, keys: list[str]) -> LoadedCall:
    """The call ``(fn, args, kwargs)``, its tensors read from the store."""
    buffers = [store_channel.get(store, key, delete=False)[0] for key in keys]
    return transport.loads(data, buffers)


def shares_memory(probe: str) -> bool:
    """Whether this rank is on the controller's machine (it sees the controller's ``probe`` file in /dev/shm):
    then its tensors travel in shared-memory files, else through the store."""
    return os.path.exists(probe)


def _dump(shm_prefix: str | None, result: Any) -> tuple[bytes, list[Any]]:
    """The pickled result and the tensor buffers that go through the store: none with ``shm_prefix`` (the
    tensors go into files there, which the controller unlinks once it has mapped them)."""
    if shm_prefix is None:
        return transport.OutOfBand().dumps(result)
    files = transport.TensorFiles(shm_prefix, reader_unlinks=True)
    try:
        return transport.dumps(result, files), []
    except BaseException:
        files.remove()
        raise


def _control(core: WorkerCore, stop: threading.Event) -> None:
    """Heartbeats, and the controller's cancel and stacks requests, while the main thread runs calls;
    ends when ``stop`` is set or the store goes away (torchrun is tearing the job down)."""
    store = store_channel.connect()
    seq, beat = 0, 0.0
    while not stop.is_set():
        try:
            if time.monotonic() - beat >= HEARTBEAT_S:
                store.set(f"beat/{core.rank}", f"{time.time()} {rss_mb()}")
                beat = time.monotonic()
            key = f"ctl/{core.rank}/{seq}"
            if not store.check([key]):
                stop.wait(CONTROL_EVERY_S)
                continue
            msg = store_channel.get_object(store, key, delete=True)
            seq += 1
            if msg[0] == "cancel":
                core.cancel(msg[1])
            elif msg[0] == "stacks":
                store_channel.put_object(store, f"stacks/{core.rank}", core.stacks())
        except dist.DistError:
            return
