"""``Cluster``: run a function on every rank (SPMD), watch the workers, shut them down."""

from __future__ import annotations

import glob
import itertools
import logging
import os
import pickle
import secrets
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlkit.runtime import local, transport
from rlkit.runtime.channel import ControlListener
from rlkit.runtime.errors import RELAUNCH_HINT, ClusterBroken, RankFailure, RemoteError
from rlkit.runtime.logs import OutputForwarder

logger = logging.getLogger(__name__)

_STRAGGLER_WARN_S = 2.0
STATUS_COLUMNS = ["rank", "pid", "host", "device", "alive", "busy", "heartbeat_age_s", "rss_mb"]


class PerRank:
    """One value per rank for one argument: ``cluster.run(fn, PerRank([a0, a1]))`` gives rank r
    ``items[r]``. Only top-level positional and keyword arguments are split."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"PerRank({self.items!r})"


class Cluster:
    """Workers started by ``rlkit.launch``; use ``run``, ``status`` and ``shutdown``.

    If one rank raises while others are still running (typically blocked in a collective that
    the failed rank never reached), ``run`` waits ``error_grace_s`` seconds for them, then shuts
    the cluster down and raises.
    """

    error_grace_s: float = 30.0

    def __init__(self, world_size: int, *, device: str, timeout: float,
                 log_dir: str | os.PathLike | None, env: dict[str, str] | None) -> None:
        self.id = secrets.token_hex(6)
        self.world_size = world_size
        self.log_dir = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"rlkit-{self.id}-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._shm_prefix = f"{transport.shm_dir()}/rlkit-{self.id}-"
        self._workers: list[local.Worker] = []
        self._output = OutputForwarder()
        self._io_lock = threading.Lock()  # one thread at a time talks to the workers
        self._call_ids = itertools.count()
        self._broken: str | None = None
        self._closed = False
        self._listener = ControlListener()
        self.address: tuple[str, int] = self._listener.address
        # Stops the workers if this object is garbage-collected without shutdown().
        self._finalizer = weakref.finalize(self, _teardown, self._workers, self._listener,
                                           self._output, self._shm_prefix)
        try:
            self.device = local.start(
                self._workers, self._listener, world_size=world_size, device=device,
                timeout=timeout, log_dir=self.log_dir, env=env, shm_prefix=self._shm_prefix,
                output=self._output)
        except BaseException:
            self.shutdown()
            raise

    # -- calls ---------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; returns one result per rank, in rank order.

        Arguments wrapped in ``PerRank`` give each rank its own item. Everything travels by value
        (cloudpickle; tensors through shared memory). Raises ``RemoteError`` if any rank raised,
        ``WorkerDied`` if a worker died (the cluster is then broken).
        """
        self._check_usable()
        if not callable(fn):
            raise TypeError(f"cluster.run needs a callable, got {type(fn).__name__}")
        per_rank = self._split(args, kwargs)
        payloads, files = self._pickle_calls(fn, per_rank)
        if not self._io_lock.acquire(blocking=False):
            files.remove()
            raise RuntimeError("another cluster.run is in progress (in another thread)")
        try:
            return self._call(payloads, files)
        except KeyboardInterrupt:
            self._break("a call was interrupted by KeyboardInterrupt")
            raise
        finally:
            files.remove()
            self._io_lock.release()

    def _split(self, args: tuple, kwargs: dict[str, Any]) -> list[tuple[tuple, dict[str, Any]]]:
        named = [(f"argument {i}", v) for i, v in enumerate(args)]
        named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        for name, value in named:
            if isinstance(value, PerRank) and len(value) != self.world_size:
                raise ValueError(f"PerRank for {name} has {len(value)} items; the cluster has "
                                 f"world_size={self.world_size}")

        def pick(value: Any, rank: int) -> Any:
            return value.items[rank] if isinstance(value, PerRank) else value

        return [(tuple(pick(v, r) for v in args), {k: pick(v, r) for k, v in kwargs.items()})
                for r in range(self.world_size)]

    def _pickle_calls(self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]
                      ) -> tuple[list[bytes], transport.TensorFiles]:
        """Pickle every rank's call before sending anything; tensors shared by ranks are written once."""
        files = transport.TensorFiles(self._shm_prefix, reader_unlinks=False)
        payloads = []
        for rank, (args, kwargs) in enumerate(per_rank):
            try:
                payloads.append(transport.dumps((fn, args, kwargs), files))
            except Exception as exc:
                files.remove()
                raise _unpicklable(fn, args, kwargs, rank, exc) from exc
            except BaseException:
                files.remove()
                raise
        return payloads, files

    def _call(self, payloads: list[bytes], files: transport.TensorFiles) -> list[Any]:
        call_id = next(self._call_ids)
        self._output.hold()
        finished = False
        try:
            for worker, payload in zip(self._workers, payloads):
                worker.busy = True
                try:
                    worker.conn.send(("call", call_id, payload))
                except OSError:
                    worker.disconnected = True
            results, failures = self._collect(call_id, files)
            finished = True
        finally:
            self._output.release(call_id if finished else None)
        if failures:
            raise RemoteError(failures)
        return [results[rank] for rank in range(self.world_size)]

    def _collect(self, call_id: int, files: transport.TensorFiles
                 ) -> tuple[dict[int, Any], list[RankFailure]]:
        results: dict[int, Any] = {}
        failures: list[RankFailure] = []
        loaded: set[int] = set()
        failed_at: float | None = None
        warned = False
        while len(results) + len(failures) < self.world_size:
            for worker, msg in local.receive(self._workers, 0.2):
                if msg[0] == "loaded" and msg[1] == call_id:
                    loaded.add(worker.rank)
                    if len(loaded) == self.world_size:  # every rank has mapped the arguments
                        files.remove()
                elif msg[0] == "result" and msg[1] == call_id:
                    worker.busy = False
                    self._take_result(worker, msg[2], msg[3], results, failures)
            self._output.flush()
            if self._closed:
                raise ClusterBroken(f"the cluster was shut down during the call: {RELAUNCH_HINT}")
            dead = local.find_dead(self._workers)
            if dead is not None:
                error = local.died(dead, "a call", self._output)
                self._break(f"rank {dead.rank} died")
                raise error
            if failures:
                failed_at = failed_at or time.monotonic()
                warned = self._check_stragglers(failures, time.monotonic() - failed_at, warned)
        return results, failures

    def _check_stragglers(self, failures: list[RankFailure], waited: float, warned: bool) -> bool:
        """After a rank failed, the others get ``error_grace_s``, then the cluster is broken.
        Warns once (returns True once it has warned)."""
        stuck = [w.rank for w in self._workers if w.busy]
        if waited > self.error_grace_s:
            self._break(f"ranks {stuck} did not finish after rank {failures[0].rank} failed")
            raise RemoteError(failures, note=(
                f"ranks {stuck} did not finish within {self.error_grace_s:g} s after that "
                f"(blocked in a collective?), so the cluster was shut down: {RELAUNCH_HINT}"))
        if waited > _STRAGGLER_WARN_S and not warned:
            logger.warning("rank %d raised %s; waiting up to %g s for ranks %s", failures[0].rank,
                           failures[0].exc_type, self.error_grace_s, stuck)
            return True
        return warned

    @staticmethod
    def _take_result(worker: local.Worker, ok: bool, data: Any, results: dict[int, Any],
                     failures: list[RankFailure]) -> None:
        if not ok:
            failures.append(RankFailure(worker.rank, worker.host, worker.device, data["type"],
                                        data["message"], data["traceback"]))
            return
        try:
            results[worker.rank] = transport.loads(data)
        except Exception as exc:  # noqa: BLE001 - reported as this rank's failure
            failures.append(RankFailure(
                worker.rank, worker.host, worker.device, type(exc).__name__,
                f"its result cannot be loaded in the controller: {exc}", traceback.format_exc()))

    # -- state ---------------------------------------------------------------------------------

    def status(self) -> pd.DataFrame:
        """One row per rank: rank, pid, host, device, alive, busy, heartbeat_age_s, rss_mb."""
        if self._io_lock.acquire(blocking=False):  # during a call, run() keeps the rows fresh
            try:
                for worker, msg in local.receive(self._workers, 0):
                    logger.debug("rank %d: ignored %r outside a call", worker.rank, msg[0])
            finally:
                self._io_lock.release()
        now = time.time()
        rows = [[w.rank, w.pid, w.host, w.device, local.exit_code(w.proc) is None, w.busy,
                 now - w.heartbeat, w.rss_mb] for w in self._workers]
        return pd.DataFrame(rows, columns=STATUS_COLUMNS)

    @property
    def closed(self) -> bool:
        """True once the cluster is shut down (or broken, which shuts it down)."""
        return self._closed

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ClusterBroken(f"cluster is broken ({self._broken}): {RELAUNCH_HINT}")
        if self._closed:
            raise ClusterBroken(f"cluster has been shut down: {RELAUNCH_HINT}")

    def _break(self, reason: str) -> None:
        self._broken = reason
        logger.error("cluster %s is broken (%s); shutting its workers down", self.id, reason)
        self.shutdown()

    # -- lifetime ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker (ask, then SIGTERM, then SIGKILL) and remove leftover shared-memory
        files. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "shut down" if self._closed else "running"
        return (f"Cluster(id={self.id!r}, world_size={self.world_size}, "
                f"device={getattr(self, 'device', '?')!r}, {state}, log_dir='{self.log_dir}')")


def _teardown(workers: list[local.Worker], listener: ControlListener, output: OutputForwarder,
              shm_prefix: str) -> None:
    """Stop the workers, forward their last output, delete this cluster's shared-memory files."""
    listener.close()
    local.stop(workers)
    output.join(timeout=2.0)
    output.release(None)
    for path in glob.glob(glob.escape(shm_prefix) + "*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _unpicklable(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], rank: int,
                 exc: Exception) -> pickle.PicklingError:
    """A clear error naming the function or argument that cannot be sent."""
    def kind(value: Any) -> str:
        cls = type(value)
        return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"

    named = [(f"the function {getattr(fn, '__qualname__', repr(fn))}", fn)]
    named += [(f"argument {i} ({kind(v)})", v) for i, v in enumerate(args)]
    named += [(f"keyword argument {k!r} ({kind(v)})", v) for k, v in kwargs.items()]
    what, error = transport.find_unpicklable(named) or ("the call", exc)
    return pickle.PicklingError(
        f"cannot send {what} to the workers (for rank {rank}): {type(error).__name__}: {error}. "
        "Functions and arguments travel by value (cloudpickle): pass picklable data, or build "
        "the object on the workers inside fn (context().state keeps it between calls).")
