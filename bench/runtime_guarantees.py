"""The runtime's guarantees, measured in one run on the local backend, 2 CPU ranks (figures, not a test).

    python bench/runtime_guarantees.py [--repeats 3] [--cycles 12]

Prints, for README's "When a call goes wrong": how fast a killed rank is named, an interrupt returns
and a rank stuck in a collective is reported; what ``--cycles`` launch/run/shutdown cycles leave behind;
which sockets the cluster's processes listen on; and what becomes of peers without the secret.
Memory over 1,000 training steps is ``bench/soak.py``'s.
"""

from __future__ import annotations

import _thread
import argparse
import glob
import ipaddress
import multiprocessing
import os
import pickle
import signal
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client

import psutil
import torch
import torch.distributed as dist

import rlkit
from rlkit.runtime import Cluster, WorkerDied, WorkerHung, context


def _after(seconds: float, action: Callable[[], None]) -> dict[str, float]:
    """Run ``action`` in ``seconds`` from a timer thread; returns ``{"at": when it ran}``."""
    fired: dict[str, float] = {}

    def fire() -> None:
        fired["at"] = time.monotonic()
        action()

    threading.Timer(seconds, fire).start()
    return fired


def _all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def killed_rank_named_s(cluster: Cluster) -> float:
    """Seconds from SIGKILL of rank 1 (mid-call) to ``WorkerDied`` naming it."""
    pid = int(cluster.status().pid[1])
    fired = _after(1.0, lambda: os.kill(pid, signal.SIGKILL))
    try:
        cluster.run(time.sleep, 30)
    except WorkerDied as exc:
        assert exc.rank == 1
        return time.monotonic() - fired["at"]
    raise AssertionError("no WorkerDied")


def interrupt_returns_s(cluster: Cluster) -> float:
    """Seconds from KeyboardInterrupt (mid-call) to ``run`` returning control, cluster still usable."""
    fired = _after(1.0, _thread.interrupt_main)
    try:
        cluster.run(time.sleep, 30)
    except KeyboardInterrupt:
        seconds = time.monotonic() - fired["at"]
        assert cluster.run(_all_reduce) == [2.0, 2.0]
        return seconds
    raise AssertionError("no KeyboardInterrupt")


def hang_reported_s(cluster: Cluster, hang_timeout: float = 2.0) -> float:
    """Seconds past ``hang_timeout`` until a rank blocked in a collective the other rank skipped
    is reported (``WorkerHung``)."""
    cluster.hang_timeout = hang_timeout

    def fn() -> None:
        if context().rank == 0:
            dist.barrier()

    start = time.monotonic()
    try:
        cluster.run(fn)
    except WorkerHung:
        return time.monotonic() - start - hang_timeout
    raise AssertionError("no WorkerHung")


def footprint(cluster_ids: list[str]) -> dict[str, float]:
    me = psutil.Process()
    left = [p for i in cluster_ids for d in ("/dev/shm", tempfile.gettempdir())
            for p in glob.glob(f"{d}/rlkit-{i}-*") if "-logs-" not in p]
    return {"child processes": len(me.children(recursive=True)), "fds": me.num_fds(),
            "threads": threading.active_count(), "shm files and private dirs": len(left),
            "controller RSS MiB": me.memory_info().rss / 2**20}


def relaunch_cycles(cycles: int) -> dict[str, tuple[float, float]]:
    """``(before, after)`` of what this process holds, over ``cycles`` launch/run/shutdown cycles
    (after one warm-up cycle)."""
    ids: list[str] = []
    big = torch.randn(1024, 1024)
    for index in range(cycles + 1):
        if index == 1:
            before = footprint(ids)
        cluster = rlkit.launch(2, device="cpu")
        ids.append(cluster.id)
        cluster.run(lambda x: x * 2, big)
        cluster.run(_all_reduce)
        cluster.shutdown()
    after = footprint(ids)
    return {k: (before[k], after[k]) for k in before}


def listening_sockets(cluster: Cluster, before: set) -> tuple[int, list]:
    """How many sockets the controller (opened since ``before``) and the workers (and their
    children) listen on, and those not on loopback."""
    procs = [psutil.Process()] + [p for pid in cluster.status().pid for p in
                                  [psutil.Process(int(pid)), *psutil.Process(int(pid)).children(recursive=True)]]
    found = {(p.pid, c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN} - before
    return len(found), [s for s in found if not ipaddress.ip_address(s[1]).is_loopback]


def peers_without_the_secret(cluster: Cluster) -> dict[str, float]:
    """For each kind of peer: milliseconds ``cluster.run`` took just after it was refused."""
    bare_pickle = pickle.dumps(("result", 0, True, b"forged"))
    peers = {"bare pickle": struct.pack("!i", len(bare_pickle)) + bare_pickle,
             "HTTP request": b"GET / HTTP/1.1\r\nHost: rlkit\r\n\r\n", "random bytes": os.urandom(300)}
    out = {}
    try:
        Client(cluster.address, authkey=b"wrong key")
    except multiprocessing.AuthenticationError:
        start = time.perf_counter()
        cluster.run(_all_reduce)
        out["wrong key"] = 1e3 * (time.perf_counter() - start)
    for name, data in peers.items():
        with socket.create_connection(cluster.address) as sock:
            sock.sendall(data)
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        start = time.perf_counter()
        cluster.run(_all_reduce)
        out[name] = 1e3 * (time.perf_counter() - start)
    with socket.create_connection(cluster.address):  # a silent peer, connected during the call
        start = time.perf_counter()
        cluster.run(_all_reduce)
        out["silent peer (still connected)"] = 1e3 * (time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=12)
    args = parser.parse_args()
    me = psutil.Process()
    before = {(me.pid, c.laddr.ip, c.laddr.port) for c in me.net_connections(kind="inet")
              if c.status == psutil.CONN_LISTEN}
    cluster = rlkit.launch(2, device="cpu")
    cluster.run(_all_reduce)
    total, exposed = listening_sockets(cluster, before)
    print(f"listening sockets of the controller, 2 workers and their children: {total}, beyond loopback: "
          f"{len(exposed)} {exposed or ''}")
    for name, ms in peers_without_the_secret(cluster).items():
        print(f"refused: {name}; the next cluster.run returned in {ms:.1f} ms")
    interrupts = [interrupt_returns_s(cluster) for _ in range(args.repeats)]
    kills, hangs = [], []
    for _ in range(args.repeats):
        kills.append(killed_rank_named_s(rlkit.launch(2, device="cpu")))
        hangs.append(hang_reported_s(rlkit.launch(2, device="cpu")))
    for name, values in (("interrupt returned control (s)", interrupts), ("killed rank named (s)", kills),
                         ("stuck rank reported after hang_timeout (s)", hangs)):
        print(f"{name}: median {statistics.median(values):.2f}, max {max(values):.2f} of {len(values)}")
    for name, (first, last) in relaunch_cycles(args.cycles).items():
        print(f"{args.cycles} relaunch cycles, {name}: {first:.1f} before, {last:.1f} after")


if __name__ == "__main__":
    main()
