"""``Cluster``: run a function on every rank (SPMD), watch the call, shut the workers down.

The cluster is the same for every backend; a backend (``LocalBackend``, ``RayBackend``) moves the
calls and results and manages the workers.

Watching a call: a worker that dies is reported at once (``WorkerDied``). A call is declared hung
(``WorkerHung``, or ``RemoteError`` when another rank raised) when some ranks are still running
``hang_timeout`` seconds after another rank finished it (returned or raised): the signature of a
rank stuck in a collective that the others never entered. A rank that raises ``CollectiveAbandoned``
says so itself: the others are declared hung at once. ``call_timeout`` (off by default) bounds
every call, which also catches all ranks stuck at once. The hung ranks' Python stacks go into
the error; they are then cancelled, and if they do not stop (blocked inside a collective) the
cluster is shut down. A KeyboardInterrupt (the notebook's stop button) cancels the call the same
way, so the kernel gets control back within seconds. ``restart`` replaces the workers of a broken
cluster by fresh ones.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from rlkit.runtime import transport
from rlkit.runtime.core import CANCELLED
from rlkit.runtime.errors import (
    RELAUNCH_HINT,
    ClusterBroken,
    CollectiveAbandoned,
    RankFailure,
    WorkerDied,
    WorkerHung,
    remote_error,
)
from rlkit.runtime.logs import LogFolder, OutputForwarder

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0  # how long cancelled ranks get to stop before the cluster is shut down
STACKS_WAIT_S = 2.0
ABANDONED = f"{CollectiveAbandoned.__module__}.{CollectiveAbandoned.__qualname__}"
"""The ``exc_type`` of a rank's ``CollectiveAbandoned``."""
STATUS_COLUMNS = ["rank", "pid", "host", "device", "alive", "busy", "call", "heartbeat_age_s",
                  "rss_mb"]


class Backend(Protocol):
    """What ``Cluster`` needs from a backend (see ``LocalBackend`` for the reference)."""

    world_size: int
    device: str
    output: OutputForwarder
    address: Any

    @property
    def log_dir(self) -> Path | None: ...

    def encode(self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]: ...
    def send(self, call_id: int, payloads: list[Any]) -> None: ...
    def poll(self, timeout: float) -> list[tuple[int, int, bool, Any]]: ...
    def end_call(self) -> None: ...
    def cancel(self, call_id: int, ranks: list[int]) -> None: ...
    def stacks(self, ranks: list[int], timeout: float) -> dict[int, str]: ...
    def find_dead(self, during: str) -> WorkerDied | None: ...
    def rows(self) -> list[dict[str, Any]]: ...
    def stop(self) -> None: ...


class PerRank:
    """One value per rank for one argument: ``cluster.run(fn, PerRank([a0, a1]))`` gives rank r
    ``items[r]``. Only top-level positional and keyword arguments are split."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"PerRank({self.items!r})"


@dataclass
class _Call:
    """One call in flight: what came back so far."""

    id: int
    name: str
    started: float = field(default_factory=time.monotonic)
    results: dict[int, Any] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    first_done: tuple[float, int, str] | None = None  # (when, rank, "returned"/"raised")

    def take(self, rank: int, ok: bool, value: Any) -> None:
        if self.first_done is None:
            self.first_done = (time.monotonic(), rank, "returned" if ok else "raised")
        if ok:
            self.results[rank] = value
        else:
            self.failures.append(value)

    def running(self, world_size: int) -> list[int]:
        finished = set(self.results) | {f.rank for f in self.failures}
        return [r for r in range(world_size) if r not in finished]


class Cluster:
    """Workers started by ``rlkit.launch``; use ``run``, ``status`` and ``shutdown`` (``restart`` for fresh
    workers once it broke).

    ``hang_timeout`` (seconds) and ``call_timeout`` (seconds or None) can be changed at any time;
    see the module docstring.
    """

    def __init__(self, make_backend: Callable[[str], Backend], *, hang_timeout: float,
                 call_timeout: float | None, verbose: bool = False, owns_log_dir: bool = False) -> None:
        """``verbose``: forward every worker line (else vLLM's own log lines stay in the rank logs);
        ``owns_log_dir``: the log folder is this cluster's to remove at a clean shutdown."""
        self.id = secrets.token_hex(6)
        self.hang_timeout = hang_timeout
        self.call_timeout = call_timeout
        self._io_lock = threading.Lock()  # one thread at a time talks to the workers
        self._call_ids = itertools.count()
        self._call: _Call | None = None
        self._broken: str | None = None
        self._closed = False
        self._make_backend, self._verbose, self._owns_log_dir = make_backend, verbose, owns_log_dir
        self._start()

    def _start(self) -> None:
        self._backend = self._make_backend(self.id)
        self._backend.output.verbose = self._verbose
        log_dir = self._backend.log_dir
        self._logs = None if log_dir is None else LogFolder(Path(log_dir), owned=self._owns_log_dir)
        # Stops the workers if this object is garbage-collected without shutdown().
        self._finalizer = weakref.finalize(self, _stop, self._backend, self._logs)

    world_size = property(lambda self: self._backend.world_size)
    device = property(lambda self: self._backend.device)
    log_dir = property(lambda self: self._backend.log_dir, doc="where the rank<N>.log files are")
    address = property(lambda self: self._backend.address, doc="the control address")

    # -- calls ---------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; returns one result per rank, in rank order.

        Arguments wrapped in ``PerRank`` give each rank its own item. Everything travels by value
        (cloudpickle; tensors through shared memory or the object store). Raises ``RemoteError``
        if any rank raised (``WorkerOutOfMemory``, a ``RemoteError``, if one ran out of memory),
        ``WorkerDied`` if a worker died, ``WorkerHung`` if ranks hung (see the module docstring);
        KeyboardInterrupt cancels the call on every rank.
        """
        self._check_usable()
        if not callable(fn):
            raise TypeError(f"cluster.run needs a callable, got {type(fn).__name__}")
        per_rank = self._split(args, kwargs)
        if not self._io_lock.acquire(blocking=False):
            raise RuntimeError("another cluster.run is in progress (in another thread)")
        try:
            payloads = self._encode(fn, per_rank)
            return self._run(_Call(next(self._call_ids), _name(fn)), payloads)
        finally:
            self._backend.end_call()
            self._call = None
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

    def _encode(self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        """Pickle every rank's call before sending anything, with a clear error if it cannot be."""
        try:
            return self._backend.encode(fn, per_rank)
        except Exception as exc:
            raise _unpicklable(fn, per_rank, exc) from exc

    def _run(self, call: _Call, payloads: list[Any]) -> list[Any]:
        output = self._backend.output
        self._call = call
        output.hold()
        finished = False
        try:
            try:
                self._backend.send(call.id, payloads)
                self._collect(call)
            except KeyboardInterrupt as exc:
                exc.add_note(self._cancel(call, "the call was interrupted (KeyboardInterrupt)"))
                raise
            finished = True
        finally:
            output.release(call.id if finished else None)
        if call.failures:
            self._failed()
            error = remote_error(call.failures, call.name)
            if self._logs is not None:
                error.add_note(f"Worker logs: {self._logs.path}")
            raise error
        return [call.results[rank] for rank in range(self.world_size)]

    def _collect(self, call: _Call) -> None:
        while call.running(self.world_size):
            self._receive(call, 0.2)
            self._watch(call)

    def _receive(self, call: _Call, timeout: float) -> None:
        """Take the results that came back; raise if the cluster died under the call."""
        for rank, call_id, ok, value in self._backend.poll(timeout):
            if call_id == call.id:
                call.take(rank, ok, value)
        self._backend.output.flush()
        if self._closed:
            raise ClusterBroken(f"the cluster was shut down during the call: {RELAUNCH_HINT}")
        dead = self._backend.find_dead(f"the call {call.name}")
        if dead is not None:
            self._failed()
            self._break(f"rank {dead.rank} died")
            raise dead

    def _watch(self, call: _Call) -> None:
        """Raise if the call hung: see the module docstring."""
        now = time.monotonic()
        abandoned = [f.rank for f in call.failures if f.exc_type == ABANDONED]
        if abandoned and call.running(self.world_size):
            self._hung(call, f"rank {abandoned[0]} raised where they wait in its collectives "
                             f"({CollectiveAbandoned.__name__})")
        if self.call_timeout is not None and now - call.started > self.call_timeout:
            self._hung(call, f"the call ran longer than call_timeout={self.call_timeout:g} s")
        if call.first_done is not None and now - call.first_done[0] > self.hang_timeout:
            _, rank, how = call.first_done
            self._hung(call, f"still running hang_timeout={self.hang_timeout:g} s after rank "
                             f"{rank} {how} (blocked in a collective that rank never entered?)")

    def _hung(self, call: _Call, reason: str) -> None:
        self._failed()
        ranks = call.running(self.world_size)
        logger.warning("ranks %s of call %s: %s; collecting their stacks", ranks, call.name, reason)
        stacks = self._backend.stacks(ranks, STACKS_WAIT_S)
        outcome = self._cancel(call, f"ranks {ranks} hung")
        broken = self._broken is not None
        if call.failures:
            stack_text = "\n".join(f"\nStacks of rank {r}:\n{stacks[r] or '(no answer)'}" for r in ranks)
            raise remote_error(call.failures, call.name, note=f"Ranks {ranks} {reason}. {outcome}{stack_text}")
        raise WorkerHung(ranks, reason, stacks, cluster_broken=broken, log_dir=str(self.log_dir))

    def _cancel(self, call: _Call, reason: str) -> str:
        """Cancel the call on the ranks still running it; if they do not all stop within
        ``CANCEL_GRACE_S`` (or a second KeyboardInterrupt comes), shut the cluster down.
        Returns a sentence saying which happened."""
        running = call.running(self.world_size)
        try:
            self._backend.cancel(call.id, running)
            deadline = time.monotonic() + CANCEL_GRACE_S
            while call.running(self.world_size) and time.monotonic() < deadline:
                self._receive(call, 0.1)
        except KeyboardInterrupt:
            pass
        except (WorkerDied, ClusterBroken) as exc:
            return f"While cancelling it: {exc}"
        still = call.running(self.world_size)
        if still:
            self._break(f"{reason}; ranks {still} could not be cancelled")
            return (f"rlkit: ranks {still} did not stop within {CANCEL_GRACE_S:g} s of being "
                    f"cancelled (blocked in a collective?), so the cluster was shut down: {RELAUNCH_HINT}")
        call.failures = [f for f in call.failures if f.exc_type != CANCELLED]
        logger.warning("%s: cancelled ranks %s; the cluster is still usable", reason, running)
        return f"rlkit: the call was cancelled on ranks {running}; the cluster is still usable."

    # -- state ---------------------------------------------------------------------------------

    def status(self) -> pd.DataFrame:
        """One row per rank: rank, pid, host, device, alive, busy, call (the function it runs),
        heartbeat_age_s, rss_mb."""
        if self._io_lock.acquire(blocking=False):  # during a call, run() keeps the rows fresh
            try:
                for rank, call_id, _, _ in self._backend.poll(0):
                    logger.debug("rank %d: ignored a result of call %d outside a call", rank, call_id)
            finally:
                self._io_lock.release()
        call, now = self._call, time.time()
        rows = []
        for row in self._backend.rows():
            name = call.name if call is not None and row["busy"] else None
            age = now - row["heartbeat"] if not math.isnan(row["heartbeat"]) else math.nan
            rows.append([row["rank"], row["pid"], row["host"], row["device"], row["alive"],
                         row["busy"], name, age, row["rss_mb"]])
        return pd.DataFrame(rows, columns=STATUS_COLUMNS)

    @property
    def closed(self) -> bool:
        """True once the cluster is shut down (or broken, which shuts it down)."""
        return self._closed

    @property
    def broken(self) -> str | None:
        """Why the cluster broke and was shut down (a rank died, or ranks could not be cancelled); None while
        it is usable, or when it was shut down on purpose."""
        return self._broken

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ClusterBroken(f"cluster is broken ({self._broken}): {RELAUNCH_HINT}")
        if self._closed:
            raise ClusterBroken(f"cluster has been shut down: {RELAUNCH_HINT}")

    def _failed(self) -> None:
        """Something went wrong on the workers: their logs are kept at shutdown."""
        if self._logs is not None:
            self._logs.failed = True

    def _break(self, reason: str) -> None:
        self._failed()
        self._broken = reason
        logger.error("cluster %s is broken (%s); shutting its workers down", self.id, reason)
        self.shutdown()

    # -- lifetime ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker (ask, then SIGTERM, then SIGKILL; Ray: kill the actors) and free
        what the cluster holds; a log folder ``rlkit.launch`` made is removed unless something
        failed (then it is kept, and logged). Idempotent."""
        self._closed = True
        self._finalizer()

    def restart(self) -> None:
        """Stop the workers (if any still run) and start fresh ones with the launch's settings: a broken
        cluster is usable again. Every role and everything the workers held (``context().state``) is gone;
        the old workers' log folder is kept when something failed there."""
        if not self._io_lock.acquire(blocking=False):
            raise RuntimeError("cannot restart while a cluster.run is in progress (in another thread)")
        try:
            self.shutdown()
            self.id = secrets.token_hex(6)
            self._start()
            self._broken, self._closed = None, False
            logger.info("restarted as %r", self)
        finally:
            self._io_lock.release()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "shut down" if self._closed else "running"
        return (f"Cluster(id={self.id!r}, backend={type(self._backend).__name__}, "
                f"world_size={self.world_size}, device={self.device!r}, {state}, "
                f"log_dir='{self.log_dir}')")


def _stop(backend: Backend, logs: LogFolder | None) -> None:
    """Stop the backend's workers, then remove or keep the log folder."""
    try:
        backend.stop()
    finally:
        if logs is not None:
            logs.close()


def _name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{module}.{qualname}" if module not in (None, "__main__") else qualname


def _unpicklable(fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]],
                 exc: Exception) -> pickle.PicklingError:
    """A clear error naming the function or argument that cannot be sent."""
    def kind(value: Any) -> str:
        cls = type(value)
        return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"

    for rank, (args, kwargs) in enumerate(per_rank):  # noqa: B007 - rank names the failing rank below
        named = [(f"the function {getattr(fn, '__qualname__', repr(fn))}", fn)]
        named += [(f"argument {i} ({kind(v)})", v) for i, v in enumerate(args)]
        named += [(f"keyword argument {k!r} ({kind(v)})", v) for k, v in kwargs.items()]
        found = transport.find_unpicklable(named)
        if found is not None:
            what, error = found
            break
    else:
        rank, what, error = 0, "the call", exc
    return pickle.PicklingError(
        f"cannot send {what} to the workers (for rank {rank}): {type(error).__name__}: {error}. "
        "Functions and arguments travel by value (cloudpickle): pass picklable data, or build "
        "the object on the workers inside fn (context().state keeps it between calls).")
