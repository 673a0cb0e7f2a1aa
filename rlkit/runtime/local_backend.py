"""The local backend's controller side: calls to worker processes on this machine.

Control messages go over the authenticated loopback channel (``channel``), tensors through
shared-memory files (``transport.TensorFiles``); the processes themselves are managed by ``local``.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.runtime import local, transport
from rlkit.runtime.channel import ControlListener
from rlkit.runtime.errors import WorkerDied, decode_reply
from rlkit.runtime.logs import OutputForwarder

Outcome = tuple[int, int, bool, Any]  # (rank, call_id, ok, result or errors.RankFailure)


class LocalBackend:
    """``world_size`` worker processes, children of this process, one per rank."""

    def __init__(self, world_size: int, *, cluster_id: str, device: str, timeout: float,
                 log_dir: Path, env: dict[str, str] | None) -> None:
        self.world_size = world_size
        self.log_dir = log_dir
        self.output = OutputForwarder()
        self._workers: list[local.Worker] = []
        self._shm_prefix = f"{transport.shm_dir()}/rlkit-{cluster_id}-"
        self._files: transport.TensorFiles | None = None
        self._call_id = -1
        self._loaded: set[int] = set()
        self._early: list[Outcome] = []  # results that arrived while waiting for stacks
        self._listener = ControlListener()
        self.address: tuple[str, int] = self._listener.address
        # Only this user can enter it (mode 0700): the process group's rendezvous file. Its owner file names
        # this process, so that a later launch removes it if this process was killed (no shutdown ran).
        remove_orphaned_dirs()
        self._private_dir = Path(tempfile.mkdtemp(prefix=f"rlkit-{cluster_id}-{PRIVATE}"))
        (self._private_dir / OWNER).write_text(str(os.getpid()))
        try:
            self.device = local.start(
                self._workers, self._listener, world_size=world_size, device=device,
                timeout=timeout, log_dir=log_dir, env=env, shm_prefix=self._shm_prefix,
                private_dir=self._private_dir, output=self.output)
        except BaseException:
            self.stop()
            raise

    # -- one call -------------------------------------------------------------------------------

    def encode(self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[bytes]:
        """Pickle every rank's call; tensors shared by ranks are written once."""
        self._files = transport.TensorFiles(self._shm_prefix, reader_unlinks=False)
        try:
            return [transport.dumps((fn, args, kwargs), self._files) for args, kwargs in per_rank]
        except BaseException:
            self.end_call()
            raise

    def send(self, call_id: int, payloads: list[bytes]) -> None:
        self._call_id = call_id
        self._loaded.clear()
        for worker, payload in zip(self._workers, payloads, strict=True):
            worker.busy = True
            self._send(worker, ("call", call_id, payload))

    def poll(self, timeout: float) -> list[Outcome]:
        """Wait up to ``timeout`` s; the calls that finished, as ``(rank, call_id, ok, value)``."""
        done, self._early = self._early, []
        for worker, msg in local.receive(self._workers, 0.0 if done else timeout):
            self._handle(worker, msg, done, {})
        return done

    def end_call(self) -> None:
        """Delete the call's shared-memory files (if some rank never loaded them)."""
        if self._files is not None:
            self._files.remove()
            self._files = None

    def cancel(self, call_id: int, ranks: list[int]) -> None:
        for rank in ranks:
            self._send(self._workers[rank], ("cancel", call_id))

    def stacks(self, ranks: list[int], timeout: float) -> dict[int, str]:
        """Each rank's Python stacks ('' for a rank that did not answer within ``timeout`` s)."""
        stacks: dict[int, str] = {}
        asked = [r for r in ranks if self._send(self._workers[r], ("stacks",))]
        deadline = time.monotonic() + timeout
        while any(r not in stacks for r in asked) and time.monotonic() < deadline:
            for worker, msg in local.receive(self._workers, 0.1):
                self._handle(worker, msg, self._early, stacks)
        return {r: stacks.get(r, "") for r in ranks}

    def find_dead(self, during: str) -> WorkerDied | None:
        dead = local.find_dead(self._workers)
        return None if dead is None else local.died(dead, during, self.output)

    def _handle(self, worker: local.Worker, msg: tuple, done: list[Outcome],
                stacks: dict[int, str]) -> None:
        kind = msg[0]
        if kind == "loaded" and msg[1] == self._call_id:
            self._loaded.add(worker.rank)
            if len(self._loaded) == self.world_size:  # every rank has mapped the arguments
                self.end_call()
        elif kind == "result":
            worker.busy = False
            done.append((worker.rank, msg[1], msg[2], _decode(worker, msg[2], msg[3])))
        elif kind == "stacks":
            stacks[worker.rank] = msg[1]

    @staticmethod
    def _send(worker: local.Worker, msg: tuple) -> bool:
        if worker.conn is None or worker.disconnected:
            return False
        try:
            worker.conn.send(msg)
        except OSError:
            worker.disconnected = True
            return False
        return True

    # -- state and lifetime ---------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, pid, host, device, alive, busy, heartbeat (unix time), rss_mb."""
        return [{"rank": w.rank, "pid": w.pid, "host": w.host, "device": w.device,
                 "alive": local.exit_code(w.proc) is None, "busy": w.busy,
                 "heartbeat": w.heartbeat, "rss_mb": w.rss_mb} for w in self._workers]

    def stop(self) -> None:
        """Stop the workers, forward their last output, delete this cluster's shared-memory files
        and private directory."""
        self._listener.close()
        local.stop(self._workers)
        self.output.join(timeout=2.0)
        self.output.release(None)
        shutil.rmtree(self._private_dir, ignore_errors=True)
        for path in glob.glob(glob.escape(self._shm_prefix) + "*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


PRIVATE = "private-"
OWNER = "owner.pid"


def remove_orphaned_dirs() -> None:
    """Remove the private directories (rendezvous files) of local clusters whose controller process is gone
    (killed: it could not remove its own), among this user's in the temporary directory."""
    for path in Path(tempfile.gettempdir()).glob(f"rlkit-*-{PRIVATE}*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _decode(worker: local.Worker, ok: bool, data: Any) -> Any:
    """A worker's reply: the loaded result, or a ``RankFailure``."""
    return decode_reply(worker.rank, worker.host, worker.device, ok, data, transport.loads)
