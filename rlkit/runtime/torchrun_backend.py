"""The torchrun backend's controller side: calls to the ranks torchrun started, through its store.

Under ``torchrun ... -m rlkit train CONFIG`` every process is already a rank; rank 0 runs the controller
in a thread beside its own worker (:mod:`rlkit.runtime.torchrun`). ``TorchrunBackend`` moves the
``Cluster``'s calls and results through torchrun's key-value store (:mod:`rlkit.runtime.store_channel`).
Tensors do not go through the store where they need not: ranks that share this machine's memory (they see a
probe file the controller writes into ``/dev/shm``) get and return them in shared-memory files, as the local
backend's workers do; only ranks on other nodes read them from the store (each distinct tensor written once,
in chunks, however many ranks read it; about 100-200 MB/s through torch's store, against GB/s in files).

Each rank writes its own output to where torchrun sends it (the terminal, or ``torchrun --log-dir``),
so nothing is forwarded here. A rank that dies is found by its process (ranks on this node) or by its
heartbeat (other nodes); torchrun itself stops the other ranks within its monitor interval (0.1 s)
and names the rank that failed.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import pickle
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from rlkit.runtime import store_channel, transport
from rlkit.runtime.errors import RankFailure, RemoteError, WorkerDied, decode_reply
from rlkit.runtime.local import choose_device
from rlkit.runtime.logs import OutputForwarder

logger = logging.getLogger(__name__)

Outcome = tuple[int, int, bool, Any]  # (rank, call_id, ok, result or RankFailure)
BEATS_EVERY_S = 0.5
"""How often the heartbeats are read."""
SILENT_S = 15.0
"""A rank on another node whose heartbeat is older than this is taken for dead (ranks on this node: by pid)."""


class TorchrunBackend:
    """The ``WORLD_SIZE`` ranks torchrun started; rank 0's controller talks to them (itself included)."""

    def __init__(self, *, cluster_id: str, device: str, timeout: float) -> None:
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.log_dir = None  # each rank's output goes where torchrun sends it
        self.output = OutputForwarder()  # no streams: nothing to forward
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self._store = store_channel.connect()
        self._sent = [0] * self.world_size  # next message number of each rank's main loop
        self._controlled = [0] * self.world_size  # ... and of its control thread
        self._infos: list[dict[str, Any]] = []
        self._beats: dict[int, tuple[float, float]] = {}
        self._beats_read = 0.0
        self._call_id = -1
        self._pending: set[int] = set()
        self._shm_prefix = f"{transport.shm_dir()}/rlkit-{cluster_id}-"
        self._files: transport.TensorFiles | None = None  # the running call's tensors, for ranks on this machine
        self._buffers: list[Any] = []  # ... and for ranks on other nodes, the distinct tensor buffers
        self._args: list[str] = []  # ... kept under these keys of the store until the call ends
        self._stopped = False
        # every rank's GPUs: torchrun starts LOCAL_WORLD_SIZE ranks per node (touching CUDA is rank 0's job)
        self.device = choose_device(device, torch.cuda.device_count(), int(os.environ["LOCAL_WORLD_SIZE"]))
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        probe = Path(f"{self._shm_prefix}probe")
        probe.touch(mode=0o600)  # the ranks that see it share this machine's memory
        try:
            config = {"device": self.device, "shm_prefix": self._shm_prefix, "probe": str(probe)}
            for rank in range(self.world_size):
                self._send(rank, ("init", config))
            keys = [f"ready/{rank}" for rank in range(self.world_size)]
            if not store_channel.poll(lambda: self._store.check(keys), timeout):
                late = [r for r, key in enumerate(keys) if not self._store.check([key])]
                raise TimeoutError(f"ranks {late} did not join the process group within the launch timeout")
        finally:
            probe.unlink(missing_ok=True)
        replies = [store_channel.get_object(self._store, key, delete=False) for key in keys]
        failures = [RankFailure.from_info(r, "-", "-", e) for r, (kind, e) in enumerate(replies) if kind == "failed"]
        if failures:
            raise RemoteError(failures, note="(while starting the workers)")
        self._infos = [info for _, info in replies]

    # -- one call -------------------------------------------------------------------------------

    def encode(self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        """Pickle every rank's call: ``(data, buffer indices)``. Ranks on this machine find their tensors in
        files named in ``data``; for the others the distinct buffers wait in ``_buffers``."""
        self._files = transport.TensorFiles(self._shm_prefix, reader_unlinks=False)
        oob = transport.OutOfBand()
        index: dict[int, int] = {}
        self._buffers = []
        payloads: list[tuple[bytes, list[int]]] = []
        for rank, (args, kwargs) in enumerate(per_rank):
            if self._infos[rank]["shares_memory"]:
                payloads.append((transport.dumps((fn, args, kwargs), self._files), []))
                continue
            data, buffers = oob.dumps((fn, args, kwargs))
            for buffer in buffers:
                if id(buffer) not in index:
                    index[id(buffer)] = len(self._buffers)
                    self._buffers.append(buffer)
            payloads.append((data, [index[id(b)] for b in buffers]))
        return payloads

    def send(self, call_id: int, payloads: list[Any]) -> None:
        self._call_id = call_id
        self._args = [f"arg/{call_id}/{i}" for i in range(len(self._buffers))]
        for key, buffer in zip(self._args, self._buffers, strict=True):
            store_channel.put(self._store, key, [buffer])
        self._buffers = []
        for rank, (data, indices) in enumerate(payloads):
            self._send(rank, ("call", call_id, data, [self._args[i] for i in indices]))
        self._pending = set(range(self.world_size))

    def poll(self, timeout: float) -> list[Outcome]:
        """Wait up to ``timeout`` s; the calls that finished, as ``(rank, call_id, ok, value)``."""
        counter = f"done/{self._call_id}"
        taken = self.world_size - len(self._pending)
        if self._pending:
            store_channel.poll(lambda: self._store.add(counter, 0) > taken, timeout)
        else:
            time.sleep(timeout)
        self._read_beats()
        done = []
        for rank in sorted(self._pending):
            key = f"out/{rank}/{self._call_id}"
            if self._store.check([key]):
                self._pending.discard(rank)
                first, *buffers = store_channel.get(self._store, key, delete=True)
                ok, reply = pickle.loads(first)
                info = self._infos[rank]
                value = decode_reply(rank, info["host"], info["device"], ok, reply, partial(_loads, buffers=buffers))
                done.append((rank, self._call_id, ok, value))
        if done and not self._pending:
            self._store.delete_key(counter)
        return done

    def end_call(self) -> None:
        """Delete the call's tensor files and its buffers in the store."""
        if self._files is not None:
            self._files.remove()
            self._files = None
        for key in self._args:
            store_channel.remove(self._store, key)
        self._args = []

    def cancel(self, call_id: int, ranks: list[int]) -> None:
        for rank in ranks:
            self._control(rank, ("cancel", call_id))

    def stacks(self, ranks: list[int], timeout: float) -> dict[int, str]:
        """Each rank's Python stacks ('' for a rank that did not answer within ``timeout`` s)."""
        for rank in ranks:
            store_channel.remove(self._store, f"stacks/{rank}")
            self._control(rank, ("stacks",))
        keys = [f"stacks/{rank}" for rank in ranks]
        store_channel.poll(lambda: self._store.check(keys), timeout)
        return {
            r: store_channel.get_object(self._store, k, delete=True) if self._store.check([k]) else ""
            for r, k in zip(ranks, keys, strict=True)
        }

    def find_dead(self, during: str) -> WorkerDied | None:
        for rank, info in enumerate(self._infos):
            cause = self._death(rank, info)
            if cause:
                return WorkerDied(rank, info["pid"], None, during=during, cause=cause,
                                  log_path="torchrun's output (or its --log-dir)")  # fmt: skip
        return None

    def _death(self, rank: int, info: dict[str, Any]) -> str:
        """Why ``rank`` is taken for dead, or '' while it lives."""
        if info["host"] == socket.gethostname():
            if _gone(info["pid"]):
                return "its process is gone (torchrun's summary gives its exit code)"
            return ""
        beat = self._beats.get(rank, (math.nan, math.nan))[0]
        if time.time() - beat > SILENT_S:
            return f"no heartbeat for {SILENT_S:g} s (its node or process is gone)"
        return ""

    def _read_beats(self) -> None:
        if time.monotonic() - self._beats_read < BEATS_EVERY_S:
            return
        self._beats_read = time.monotonic()
        keys = [f"beat/{rank}" for rank in range(self.world_size)]
        for rank, key in enumerate(keys):
            if self._store.check([key]):
                try:  # unsigned (a time and a figure, never unpickled): a forged one is skipped
                    when, rss = self._store.get(key).split()
                    self._beats[rank] = (float(when), float(rss))
                except ValueError:
                    logger.warning("skipped a heartbeat of rank %d that is not 'time rss_mb'", rank)

    def _send(self, rank: int, msg: tuple) -> None:
        store_channel.put_object(self._store, f"in/{rank}/{self._sent[rank]}", msg)
        self._sent[rank] += 1

    def _control(self, rank: int, msg: tuple) -> None:
        store_channel.put_object(self._store, f"ctl/{rank}/{self._controlled[rank]}", msg)
        self._controlled[rank] += 1

    # -- state and lifetime ---------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, pid, host, device, alive, busy, heartbeat (unix time), rss_mb."""
        self._read_beats()
        rows = []
        for rank, info in enumerate(self._infos):
            beat, rss = self._beats.get(rank, (math.nan, math.nan))
            rows.append({"rank": rank, "pid": info["pid"], "host": info["host"], "device": info["device"],
                         "alive": not self._death(rank, info), "busy": rank in self._pending,
                         "heartbeat": beat, "rss_mb": rss})  # fmt: skip
        return rows

    def stop(self) -> None:
        """Cancel the running call and tell every rank to leave (rank 0's main loop included); idempotent.
        A rank stuck in a call (a collective) never reads it: rank 0 then ends its process, and torchrun
        stops the others."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.cancel(self._call_id, sorted(self._pending))
            self.end_call()
            for rank in range(self.world_size):
                self._send(rank, ("shutdown",))
        except dist.DistError as exc:  # the store is gone: torchrun is tearing the job down
            logger.warning("could not tell the ranks to stop: %s", exc)
        for path in glob.glob(glob.escape(self._shm_prefix) + "*"):  # results no one read
            Path(path).unlink(missing_ok=True)


def _loads(data: bytes, buffers: list[bytes]) -> Any:
    return transport.loads(data, buffers)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
