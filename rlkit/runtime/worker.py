"""Worker main: ``python -m rlkit.runtime.worker --address HOST:PORT --parent-pid PID``.

A fresh process started by the controller in its own session (so a Ctrl-C aimed at the kernel
does not reach it). It reads the channel secret from stdin, connects back, reports what it sees,
joins the torch.distributed process group (gloo on CPU, nccl on CUDA), then runs the calls it
receives one at a time on its main thread. It exits when told to, and at once when the control
connection closes (the controller is gone), so it never outlives the controller.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import Any

import psutil
import torch
import torch.distributed as dist

from rlkit.runtime import transport
from rlkit.runtime.channel import WorkerChannel, read_authkey
from rlkit.runtime.context import WorkerContext, set_context
from rlkit.runtime.logs import DONE_MARKER

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
_PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="controller's HOST:PORT")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--watch-parent", action="store_true",
                        help="die with the parent (Linux PR_SET_PDEATHSIG)")
    args = parser.parse_args(argv)
    if args.watch_parent:
        _die_with_parent()
    if os.getppid() != args.parent_pid:  # the controller died before we got here
        os._exit(1)
    authkey = read_authkey()
    rank = int(os.environ["RANK"])
    _configure_logging(rank)
    host, port = args.address.rsplit(":", 1)
    try:
        channel = WorkerChannel(Client((host, int(port)), authkey=authkey))
        channel.send(("hello", {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                                "cuda_devices": torch.cuda.device_count()}))
        msg = channel.recv()
    except (OSError, EOFError) as exc:
        logger.error("cannot reach the controller at %s: %s", args.address, exc)
        os._exit(1)
    if msg[0] != "init":  # stopped before start-up finished
        os._exit(0)
    config = msg[1]
    try:
        ctx = _join(rank, config)
    except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
        channel.send(("failed", _error_info(exc)))
        os._exit(1)
    set_context(ctx)
    inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(channel, inbox), name="rlkit-receive", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(channel,), name="rlkit-heartbeat", daemon=True).start()
    channel.send(("ready", {"device": str(ctx.device), "rss_mb": _rss_mb()}))
    _serve(channel, inbox, config["shm_prefix"])
    _close_state(ctx)
    _exit()


def _die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent thread exits. The controller asks for this
    only when it spawns from its main thread (the signal follows the spawning *thread*)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def _configure_logging(rank: int) -> None:
    """Log to stderr (which the controller forwards as ``[rank N] ...``); every record gets a
    ``rank`` attribute. rlkit's own level comes from RLKIT_LOG_LEVEL (default INFO)."""
    make_record = logging.getLogRecordFactory()

    def with_rank(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(with_rank)
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rlkit").setLevel(os.environ.get("RLKIT_LOG_LEVEL", "INFO").upper())


def _join(rank: int, config: dict[str, Any]) -> WorkerContext:
    """Take the controller's sys.path (so its modules import here too) and join the process group."""
    sys.path[:] = config["sys_path"] + [p for p in sys.path if p not in config["sys_path"]]
    local_rank = int(os.environ["LOCAL_RANK"])
    if config["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        dist.init_process_group(backend, device_id=device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend)
    return WorkerContext(rank=rank, world_size=dist.get_world_size(), local_rank=local_rank,
                         device=device, backend=backend, host=socket.gethostname())


def _receive(channel: WorkerChannel, inbox: queue.SimpleQueue) -> None:
    """Pass messages to the main thread; exit the process when the controller goes away."""
    while True:
        try:
            msg = channel.recv()
        except (EOFError, OSError):
            os._exit(1)
        inbox.put(msg)
        if msg[0] == "shutdown":
            return


def _heartbeat(channel: WorkerChannel) -> None:
    while True:
        try:
            channel.send(("heartbeat", time.time(), _rss_mb()))
        except OSError:
            return
        time.sleep(HEARTBEAT_S)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _serve(channel: WorkerChannel, inbox: queue.SimpleQueue, shm_prefix: str) -> None:
    while True:
        msg = inbox.get()
        if msg[0] == "shutdown":
            return
        _, call_id, payload = msg
        ok, reply = _execute(channel, call_id, payload, shm_prefix)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, f"{DONE_MARKER}{call_id}\n".encode())
        channel.send(("result", call_id, ok, reply))


def _execute(channel: WorkerChannel, call_id: int, payload: bytes, shm_prefix: str) -> tuple[bool, Any]:
    """Run one call; (True, pickled result) or (False, error info)."""
    try:
        fn, args, kwargs = transport.loads(payload)
        channel.send(("loaded", call_id))
        result = fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        return False, _error_info(exc)
    files = transport.TensorFiles(shm_prefix, reader_unlinks=True)
    try:
        return True, transport.dumps(result, files)
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        files.remove()
        return False, _error_info(exc, "the function returned, but its result cannot be sent back: ")


def _error_info(exc: BaseException, prefix: str = "") -> dict[str, str]:
    """Text of an exception, without this module's own frame."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return {"type": name, "message": prefix + str(exc),
            "traceback": "".join(traceback.format_exception(cls, exc, tb))}


def _close_state(ctx: WorkerContext) -> None:
    """Call ``close()`` on every value in the context's state that has one (rollout engines own
    processes that would otherwise outlive this one); a failure is logged, not raised."""
    for key, value in list(ctx.state.items()):
        close = getattr(value, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("closing state[%r] failed", key)


def _exit() -> None:
    """Leave the process group and exit without waiting for threads user code may have left."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        logger.exception("destroy_process_group failed")
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
