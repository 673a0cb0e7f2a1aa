"""Worker main: ``python -m rlkit.runtime.worker --address HOST:PORT --parent-pid PID``.

A fresh process started by the controller in its own session (so a Ctrl-C aimed at the kernel
does not reach it). It reads the channel secret from stdin, connects back, reports what it sees,
joins the torch.distributed process group (gloo on CPU, nccl on CUDA) through its ``WorkerCore``,
then runs the calls it receives one at a time on its main thread. A receiving thread handles
"cancel" and "stacks" requests while a call runs. The process exits when told to, and at once
when the control connection closes (the controller is gone), so it never outlives the controller.
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
from functools import partial
from multiprocessing.connection import Client
from typing import Any

import torch
import torch.distributed as dist

from rlkit.runtime import transport
from rlkit.runtime.channel import WorkerChannel, read_authkey
from rlkit.runtime.context import WorkerContext
from rlkit.runtime.core import WorkerCore, error_info, mark_output_end, rss_mb

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
    configure_logging(rank)
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
    core = WorkerCore(rank)
    try:
        ctx = core.join(config)
    except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
        channel.send(("failed", error_info(exc)))
        os._exit(1)
    inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(channel, inbox, core), name="rlkit-receive",
                     daemon=True).start()
    threading.Thread(target=_heartbeat, args=(channel,), name="rlkit-heartbeat", daemon=True).start()
    channel.send(("ready", {"device": str(ctx.device), "rss_mb": rss_mb()}))
    _serve(channel, inbox, core, config["shm_prefix"])
    close_state(ctx)
    _exit()


def _die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent thread exits. The controller asks for this
    only when it spawns from its main thread (the signal follows the spawning *thread*)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def configure_logging(rank: int, prefix: str = "") -> None:
    """Log to stderr (which the local and Ray backends forward as ``[rank N] ...``; under torchrun,
    which forwards nothing, give that ``prefix``); every record gets a ``rank`` attribute. rlkit's own
    level comes from RLKIT_LOG_LEVEL (default INFO)."""
    make_record = logging.getLogRecordFactory()

    def with_rank(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(with_rank)
    logging.basicConfig(stream=sys.stderr, format=prefix + "%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rlkit").setLevel(os.environ.get("RLKIT_LOG_LEVEL", "INFO").upper())


def _receive(channel: WorkerChannel, inbox: queue.SimpleQueue, core: WorkerCore) -> None:
    """Answer "cancel" and "stacks" here, pass the rest to the main thread; exit the process when
    the controller goes away."""
    while True:
        try:
            msg = channel.recv()
        except (EOFError, OSError):
            os._exit(1)
        if msg[0] == "cancel":
            core.cancel(msg[1])
        elif msg[0] == "stacks":
            channel.send(("stacks", core.stacks()))
        else:
            inbox.put(msg)
        if msg[0] == "shutdown":
            return


def _heartbeat(channel: WorkerChannel) -> None:
    while True:
        try:
            channel.send(("heartbeat", time.time(), rss_mb()))
        except OSError:
            return
        time.sleep(HEARTBEAT_S)


def _serve(channel: WorkerChannel, inbox: queue.SimpleQueue, core: WorkerCore,
           shm_prefix: str) -> None:
    while True:
        msg = inbox.get()
        if msg[0] == "shutdown":
            return
        _, call_id, payload = msg
        ok, reply = core.execute(call_id, partial(_load, channel, call_id, payload),
                                 partial(_dump, shm_prefix))
        mark_output_end(call_id)
        channel.send(("result", call_id, ok, reply))


def _load(channel: WorkerChannel, call_id: int, payload: bytes) -> Any:
    """The call ``(fn, args, kwargs)``; then tells the controller, which deletes the arguments'
    files once every rank has mapped them."""
    try:
        return transport.loads(payload)
    finally:
        channel.send(("loaded", call_id))


def _dump(shm_prefix: str, result: Any) -> bytes:
    """The pickled result; its tensors go into files the controller unlinks once it has mapped them."""
    files = transport.TensorFiles(shm_prefix, reader_unlinks=True)
    try:
        return transport.dumps(result, files)
    except BaseException:
        files.remove()
        raise


def close_state(ctx: WorkerContext) -> None:
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
