"""The local backend: workers are child processes of the controller on this machine.

Process management only: spawn, start-up handshake, receiving, death detection, stopping.
``Cluster`` builds calls on top of it.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

import psutil

from rlkit.runtime.channel import ControlListener, send_authkey
from rlkit.runtime.errors import RankFailure, RemoteError, WorkerDied
from rlkit.runtime.logs import OutputForwarder, tail

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
STARTUP = "start-up"


@dataclass
class Worker:
    """The controller's handle on one worker process."""

    rank: int
    proc: subprocess.Popen
    log_path: Path
    conn: Connection | None = None
    host: str = ""
    device: str = ""
    busy: bool = False
    heartbeat: float = math.nan  # the worker's time.time() at its last heartbeat
    rss_mb: float = math.nan
    disconnected: bool = False  # its control connection hit EOF

    @property
    def pid(self) -> int:
        return self.proc.pid


def start(workers: list[Worker], listener: ControlListener, *, world_size: int, device: str,
          timeout: float, log_dir: Path, env: dict[str, str] | None, shm_prefix: str,
          private_dir: Path, output: OutputForwarder) -> str:
    """Spawn ``world_size`` workers (appended to ``workers`` as they start, so the caller can
    stop them if this raises), connect them through ``listener`` and wait until all have joined
    the process group. Returns the device kind chosen ("cpu" or "cuda").

    The process group meets in a ``FileStore`` in ``private_dir`` (a directory only this user can
    enter), not a TCP store: torch's ``TCPStore`` listens on every interface, unauthenticated.
    """
    interface = loopback_interface()
    for rank in range(world_size):
        worker = _spawn(rank, world_size, listener.address, interface, env, log_dir)
        workers.append(worker)
        assert worker.proc.stdout is not None and worker.proc.stdin is not None  # both are pipes
        output.attach(rank, worker.proc.stdout, worker.log_path)
        send_authkey(worker.proc.stdin, listener.authkey)
    deadline = time.monotonic() + timeout
    cuda_devices = _await_hellos(workers, listener, deadline, output)
    listener.seal()
    kind = choose_device(device, cuda_devices, world_size)
    config = {"device": kind, "sys_path": list(sys.path), "shm_prefix": shm_prefix,
              "init_method": f"file://{private_dir / 'rendezvous'}"}
    for worker in workers:
        try:
            assert worker.conn is not None  # every rank said hello
            worker.conn.send(("init", config))
        except OSError:  # it died; _await_ready reports it
            worker.disconnected = True
    _await_ready(workers, deadline, output)
    return kind


def _spawn(rank: int, world_size: int, address: tuple[str, int], interface: str,
           extra_env: dict[str, str] | None, log_dir: Path) -> Worker:
    cmd = [sys.executable, "-m", "rlkit.runtime.worker", "--address", f"{address[0]}:{address[1]}",
           "--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits; only the main thread lives as
        # long as the process. From other threads the worker relies on its connection closing.
        cmd.append("--watch-parent")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=_worker_env(rank, world_size, interface, extra_env))
    return Worker(rank, proc, log_dir / f"rank{rank}.log")


def _worker_env(rank: int, world_size: int, interface: str,
                extra: dict[str, str] | None) -> dict[str, str]:
    """The controller's environment, then ``extra``, then the torch.distributed variables, with
    gloo's and NCCL's sockets on the loopback ``interface`` (these win over ``extra``: every rank
    is on this machine). There is no MASTER_ADDR/MASTER_PORT: the ranks meet in a file store.
    OMP_NUM_THREADS (torch's intra-op threads) defaults to an equal share of the CPU cores."""
    env = {**os.environ, **(extra or {})}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    package_root = str(Path(__file__).resolve().parents[2])  # the rlkit this controller runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME=interface,
               NCCL_SOCKET_IFNAME=interface, PYTHONUNBUFFERED="1")
    return env


def loopback_interface() -> str:
    """The name of this machine's loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and ipaddress.ip_address(a.address).is_loopback
               for a in addresses):
            return name
    raise RuntimeError("this machine has no loopback network interface (127.0.0.1), which the "
                       "local backend's gloo/NCCL sockets need")


def _await_hellos(workers: list[Worker], listener: ControlListener, deadline: float,
                  output: OutputForwarder) -> int:
    """Map each authenticated connection to its rank; returns rank 0's CUDA device count."""
    infos: dict[int, dict[str, Any]] = {}
    while len(infos) < len(workers):
        _check_starting(workers, deadline, output, "connect to the controller")
        conn = listener.accept(timeout=0.2)
        if conn is None:
            continue
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            conn.close()
            continue
        try:
            kind, info = conn.recv()
        except (EOFError, OSError):  # it died right away; _check_starting reports it
            conn.close()
            continue
        worker = workers[info["rank"]]
        if kind != "hello" or worker.conn is not None:
            raise RuntimeError(f"unexpected start-up message {kind!r} for rank {info['rank']}")
        worker.conn, worker.host = conn, info["host"]
        infos[worker.rank] = info
    return infos[0]["cuda_devices"]


def choose_device(requested: str, cuda_devices: int, world_size: int) -> str:
    """"cpu" or "cuda" for a requested device, given how many GPUs the workers see."""
    if requested == "cpu" or (requested == "auto" and cuda_devices == 0):
        return "cpu"
    if cuda_devices < world_size:
        raise ValueError(f"device={requested!r}: the workers see {cuda_devices} CUDA device(s), "
                         f"too few for world_size={world_size} (one GPU per rank); lower "
                         f"world_size, or use device='cpu'")
    return "cuda"


def _await_ready(workers: list[Worker], deadline: float, output: OutputForwarder) -> None:
    pending = {w.rank for w in workers}
    while pending:
        _check_starting(workers, deadline, output, "join the process group")
        for worker, msg in receive(workers, 0.2):
            if msg[0] == "ready":
                worker.device, worker.rss_mb = msg[1]["device"], msg[1]["rss_mb"]
                worker.heartbeat = time.time()
                pending.discard(worker.rank)
            elif msg[0] == "failed":
                raise RemoteError([RankFailure.from_info(worker.rank, worker.host, "-", msg[1])],
                                  note="(while starting the workers)")


def _check_starting(workers: list[Worker], deadline: float, output: OutputForwarder,
                    step: str) -> None:
    dead = find_dead(workers)
    if dead is not None:
        raise died(dead, STARTUP, output)
    if time.monotonic() > deadline:
        late = [w.rank for w in workers if w.conn is None or not w.device]
        logs = ", ".join(str(workers[r].log_path) for r in late)
        raise TimeoutError(f"ranks {late} did not {step} within the launch timeout; "
                           f"see their logs: {logs}")


def receive(workers: list[Worker], timeout: float) -> list[tuple[Worker, tuple]]:
    """Wait up to ``timeout`` s for messages; heartbeats update the workers, EOF marks them
    disconnected, and every other message is returned with its worker."""
    by_conn = {w.conn: w for w in workers
               if w.conn is not None and not w.conn.closed and not w.disconnected}
    messages: list[tuple[Worker, tuple]] = []
    for ready in wait(list(by_conn), timeout):
        conn = cast(Connection, ready)
        worker = by_conn[conn]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "heartbeat":
                    worker.heartbeat, worker.rss_mb = msg[1], msg[2]
                else:
                    messages.append((worker, msg))
        except (EOFError, OSError):
            worker.disconnected = True
    return messages


def exit_code(proc: subprocess.Popen) -> int | None:
    """``proc``'s exit code (negative: killed by that signal) once it has exited, else None.

    The process is not reaped: while it is a zombie its pid, which is also its process-group
    id, cannot be reused, so ``stop`` can still signal what is left in its group.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def find_dead(workers: list[Worker]) -> Worker | None:
    """A worker whose process exited, or whose connection closed (given 2 s to exit)."""
    for worker in workers:
        if exit_code(worker.proc) is not None:
            return worker
    for worker in workers:
        if worker.disconnected:
            _wait_exit([worker], 2.0)
            return worker
    return None


def died(worker: Worker, during: str, output: OutputForwarder) -> WorkerDied:
    """The error for a dead worker, with the end of its log."""
    output.wait_eof(worker.rank, timeout=1.0)
    return WorkerDied(worker.rank, worker.pid, exit_code(worker.proc), during=during,
                      log_path=str(worker.log_path), log_tail=tail(worker.log_path),
                      cluster_broken=during != STARTUP)


def stop(workers: list[Worker], grace_s: float = 5.0) -> None:
    """Stop the workers: idle ones are asked to exit and get ``grace_s``; busy ones (and then
    any still running) get SIGTERM, then SIGKILL, to their whole process group. Whatever is left
    in each group (the workers' own children) is killed, then the workers are reaped."""
    running = [w for w in workers if exit_code(w.proc) is None]
    for worker in running:
        if not _ask_to_exit(worker):
            _signal_group(worker, signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if _wait_exit(running, grace_s if sig == signal.SIGTERM else 2.0):
            break
        for worker in running:
            if exit_code(worker.proc) is None:
                _signal_group(worker, sig)
    _wait_exit(running, 2.0)
    for worker in workers:
        _signal_group(worker, signal.SIGKILL)
        try:
            worker.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            logger.warning("rank %d (pid %d) did not exit after SIGKILL", worker.rank, worker.pid)
        if worker.conn is not None:
            worker.conn.close()
        worker.busy = False


def _ask_to_exit(worker: Worker) -> bool:
    """Send an idle worker the shutdown message; False if it is busy, still starting or unreachable."""
    if worker.busy or not worker.device or worker.conn is None or worker.disconnected:
        return False
    try:
        worker.conn.send(("shutdown",))
    except OSError:
        return False
    return True


def _signal_group(worker: Worker, sig: int) -> None:
    if worker.proc.returncode is not None:  # reaped: its group id may belong to someone else now
        return
    try:
        os.killpg(worker.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_exit(workers: list[Worker], timeout: float) -> bool:
    """Wait until all ``workers`` have exited (without reaping); True if they have."""
    deadline = time.monotonic() + timeout
    while any(exit_code(w.proc) is None for w in workers):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
