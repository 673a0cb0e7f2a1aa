"""``WorkerCore``: one rank's worker, the same object in every backend.

The local backend's worker process (``rlkit.runtime.worker``), the Ray backend's actor
(``rlkit.runtime.ray_actor``) and each process torchrun starts (``rlkit.runtime.torchrun``) own one.
It joins the torch.distributed process group, runs calls on the process's main thread, and, from
any other thread, cancels the running call or reports the Python stacks of the process's threads.

Cancelling: ``cancel(call_id)`` sends ``CANCEL_SIGNAL`` to the main thread, whose handler raises
``CallCancelled`` there. That interrupts Python code and blocking system calls (``time.sleep``,
socket reads) at once; code blocked inside a C/C++ call that does not return (a collective that
another rank never entered) is not interrupted, and the controller then has to stop the process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist

from rlkit.runtime import memory
from rlkit.runtime.context import WorkerContext, set_context
from rlkit.runtime.logs import DONE_MARKER

logger = logging.getLogger(__name__)

CANCEL_SIGNAL = signal.SIGUSR2
CANCELLED = "rlkit.CallCancelled"  # the "type" of a cancelled call's error info
LoadedCall = tuple[Callable[..., Any], tuple, dict[str, Any]]  # (fn, args, kwargs)


class CallCancelled(BaseException):
    """Raised on a worker's main thread when the controller cancels the running call. A
    BaseException, so that user code's ``except Exception`` does not swallow it."""


class WorkerCore:
    """One rank: process-group membership, the running call, cancellation and stacks.

    Build it on the main thread (it installs the ``CANCEL_SIGNAL`` handler there).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._main_ident: int = threading.get_ident()  # built on the main thread
        self._running: int | None = None  # id of the call running on the main thread
        self._cancel: int | None = None  # id of the call the controller wants cancelled
        self.context: WorkerContext | None = None  # set by join
        signal.signal(CANCEL_SIGNAL, self._on_cancel_signal)

    def join(self, config: dict[str, Any]) -> WorkerContext:
        """Take the controller's sys.path (so its modules import here too), set the given
        environment variables, join the process group (gloo on CPU, nccl on CUDA) and install
        the worker context.

        config: "device" ("cpu"|"cuda"), "sys_path", "env" (RANK, WORLD_SIZE, LOCAL_RANK,
        MASTER_ADDR, ... where the launcher did not set them), optionally "init_method" (where
        the ranks meet, e.g. "file:///private/dir/rendezvous"; default "env://": MASTER_ADDR and
        MASTER_PORT) and "cuda_index" (this rank's GPU; default LOCAL_RANK).
        """
        paths = config["sys_path"]
        sys.path[:] = paths + [p for p in sys.path if p not in paths]
        os.environ.update(config.get("env", {}))
        local_rank = int(os.environ["LOCAL_RANK"])
        meet = {"init_method": config.get("init_method", "env://"), "rank": self.rank,
                "world_size": int(os.environ["WORLD_SIZE"])}
        if config["device"] == "cuda":
            device, backend = torch.device("cuda", config.get("cuda_index", local_rank)), "nccl"
            torch.cuda.set_device(device)
            dist.init_process_group(backend, device_id=device, **meet)
        else:
            device, backend = torch.device("cpu"), "gloo"
            dist.init_process_group(backend, **meet)
        self.context = WorkerContext(rank=self.rank, world_size=dist.get_world_size(),
                                     local_rank=local_rank, device=device, backend=backend,
                                     host=socket.gethostname())
        set_context(self.context)
        return self.context

    def execute(self, call_id: int, load: Callable[[], LoadedCall], dump: Callable[[Any], Any]) -> tuple[bool, Any]:
        """One call as every backend runs it: ``load()`` gives ``(fn, args, kwargs)``, ``fn`` runs on
        this (main) thread, ``dump(result)`` packs its result for the controller. Returns
        ``(True, packed)`` or ``(False, error info)``, after flushing stdout and stderr."""
        ok, reply = self._execute(call_id, load, dump)
        sys.stdout.flush()
        sys.stderr.flush()
        return ok, reply

    def _execute(self, call_id: int, load: Callable[[], LoadedCall], dump: Callable[[Any], Any]) -> tuple[bool, Any]:
        try:
            fn, args, kwargs = load()
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            return False, self._failure(exc, "the call cannot be loaded on the worker: ")
        ok, result = self._run_call(call_id, fn, args, kwargs)
        if not ok:
            return False, result
        try:
            return True, dump(result)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            return False, self._failure(exc, "the function returned, but its result cannot be sent back: ")

    def _run_call(self, call_id: int, fn: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """Run ``fn`` on this (main) thread: ``(True, result)`` or ``(False, error info)``; an
        allocation failure's error info carries this rank's memory report ("memory")."""
        try:
            self._running = call_id
            try:
                if self._cancel == call_id:  # the cancel came before the call started
                    raise CallCancelled()
                return True, fn(*args, **kwargs)
            finally:
                self._running = None
        except CallCancelled:
            self._running = self._cancel = None
            return False, {"type": CANCELLED, "message": "cancelled by the controller",
                           "traceback": ""}
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported to the controller
            return False, self._failure(exc)

    def _failure(self, exc: BaseException, prefix: str = "") -> dict[str, str]:
        """``error_info``, with this rank's memory report if ``exc`` is an allocation failure
        (taken now, while the failed call's frames and their tensors are still alive)."""
        info = error_info(exc, prefix)
        if memory.is_out_of_memory(exc) and self.context is not None:
            info["memory"] = memory.report(self.context.device, self.context.memory_reports)
        return info

    def cancel(self, call_id: int) -> None:
        """Cancel call ``call_id`` (from any thread): raise ``CallCancelled`` in it if it is
        running, or as soon as it starts; a call that has finished is left alone."""
        self._cancel = call_id
        if self._running == call_id:
            signal.pthread_kill(self._main_ident, CANCEL_SIGNAL)

    def _on_cancel_signal(self, signum: int, frame: Any) -> None:
        if self._running is not None and self._cancel == self._running:
            self._cancel = None
            raise CallCancelled()

    def stacks(self) -> str:
        """The Python stack of every thread but rlkit's own, the main thread (the call) first."""
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != self._main_ident)
        parts = []
        for ident, frame in frames:
            name = names.get(ident, f"0x{ident:x}")
            if name.startswith("rlkit-"):
                continue
            entries = list(traceback.extract_stack(frame))
            calls = [i for i, e in enumerate(entries) if e.filename == __file__ and e.name == "_run_call"]
            what = ""
            if ident == self._main_ident and calls:
                what, entries = " (running the call)", entries[calls[-1] + 1:]
            parts.append(f"Thread {name}{what}, most recent call last:\n"
                         + "".join(traceback.format_list(entries)))
        return "\n".join(parts)


def mark_output_end(call_id: int) -> None:
    """Write ``DONE_MARKER`` and the call id on file descriptor 1: the local and Ray backends, which
    forward this process's output, forward everything a call printed before its result."""
    os.write(1, f"{DONE_MARKER}{call_id}\n".encode())


def rss_mb() -> float:
    """This process's resident memory in MiB."""
    return psutil.Process().memory_info().rss / 2**20


def error_info(exc: BaseException, prefix: str = "") -> dict[str, str]:
    """Text of an exception ("type", "message", "traceback"), without the innermost rlkit frame
    that called user code."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return {"type": name, "message": prefix + str(exc),
            "traceback": "".join(traceback.format_exception(cls, exc, tb))}
