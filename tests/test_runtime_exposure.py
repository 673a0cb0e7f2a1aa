"""What the local backend exposes: every socket its processes listen on is on loopback (the vLLM
engine's processes: tests/test_vllm.py), peers without the cluster's secret are refused while the cluster keeps
working, and launch/run/shutdown cycles leave no processes, fds, threads or shared memory behind."""

from __future__ import annotations

import glob
import importlib.util
import ipaddress
import logging
import multiprocessing
import os
import pickle
import socket
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Client

import psutil
import pytest
import torch
import torch.distributed as dist

import rlkit
from rlkit.runtime import context, launch
from rlkit.runtime.channel import ControlListener
from tests.test_runtime import _pids


def listening(pids: list[int]) -> set[tuple[int, str, str, int]]:
    """``(pid, process name, address, port)`` of every listening IPv4/IPv6 socket of the processes
    ``pids`` and all their descendants."""
    found = set()
    procs = {p.pid: p for pid in pids for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]}
    for proc in procs.values():
        try:
            name, connections = proc.name(), proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found |= {(proc.pid, name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def beyond_loopback(sockets: set[tuple[int, str, str, int]]) -> set[tuple[int, str, str, int]]:
    """The sockets among ``sockets`` that other machines can reach: any address but loopback
    ("0.0.0.0" and "::", every interface, included)."""
    return {s for s in sockets if not ipaddress.ip_address(s[2].split("%")[0]).is_loopback}


def all_reduce() -> float:
    t = torch.tensor([context().rank + 1.0])
    dist.all_reduce(t)
    return t.item()


@pytest.fixture(scope="module")
def _holder():
    """Keeps one cluster for the module; tests that replace it get a new one from ``cluster``."""
    holder: dict = {}
    yield holder
    if "cluster" in holder:
        holder["cluster"].shutdown()


@pytest.fixture
def cluster(_holder):
    """A 2-rank CPU cluster; ``_holder["before"]``: the sockets this (controller) process listened on
    before it started."""
    if "cluster" not in _holder or _holder["cluster"].closed:
        _holder["before"] = listening([os.getpid()])
        _holder["cluster"] = launch(2, device="cpu")
    return _holder["cluster"]


# -- loopback only -----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_no_socket_of_controller_or_workers_listens_beyond_loopback(cluster, _holder):
    before = _holder["before"]
    assert cluster.run(all_reduce) == [3.0, 3.0]  # the process group's sockets are up
    workers = _pids(cluster)
    sockets = listening(workers) | {s for s in listening([os.getpid()]) - before if s[0] == os.getpid()}
    assert beyond_loopback(sockets) == set()
    assert (os.getpid(), psutil.Process().name(), *cluster.address) in sockets  # the control channel
    assert all(any(s[0] == pid for s in sockets) for pid in workers)  # gloo listens on each rank
    assert cluster.run(lambda: ("MASTER_PORT" in os.environ, os.environ["GLOO_SOCKET_IFNAME"])) == [(False, "lo")] * 2


@pytest.mark.timeout(60)
def test_the_socket_check_flags_a_socket_on_every_interface(cluster):
    def mine() -> set:
        return {(s[0], s[2], s[3]) for s in beyond_loopback(listening([os.getpid()])) if s[0] == os.getpid()}

    before = mine()
    with socket.create_server(("0.0.0.0", 0)) as server:
        assert mine() - before == {(os.getpid(), "0.0.0.0", server.getsockname()[1])}

    def open_on_every_interface() -> int:
        server = socket.create_server(("0.0.0.0", 0))
        context().state["exposed"] = server
        return server.getsockname()[1]

    ports = cluster.run(open_on_every_interface)
    try:
        flagged = {(s[0], s[2], s[3]) for s in beyond_loopback(listening(_pids(cluster)))}
        assert flagged == {(pid, "0.0.0.0", port) for pid, port in zip(_pids(cluster), ports, strict=True)}
    finally:
        cluster.run(lambda: context().state.pop("exposed").close())
    assert beyond_loopback(listening(_pids(cluster))) == set()


# -- peers without the secret ------------------------------------------------------------------

def _closed_on(address: tuple[str, int], first_bytes: bytes) -> None:
    """Connect to ``address``, send ``first_bytes``; return when the other side closes (a reset,
    when it closes with some of them unread, counts)."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(first_bytes)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass


@pytest.mark.timeout(60)
def test_control_channel_refuses_peers_without_the_secret_and_cluster_keeps_working(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="rlkit.runtime.channel")
    with pytest.raises(multiprocessing.AuthenticationError):
        Client(cluster.address, authkey=b"not the key")
    assert cluster.run(lambda: 2) == [2, 2]
    bare_pickle = pickle.dumps(("result", 0, True, b"forged"))
    junk, http = os.urandom(4096), b"GET / HTTP/1.1\r\nHost: rlkit\r\n\r\n"
    for first_bytes in (struct.pack("!i", len(bare_pickle)) + bare_pickle, http, struct.pack("!i", 200) + junk[:200]):
        _closed_on(cluster.address, first_bytes)
        assert cluster.run(all_reduce) == [3.0, 3.0]
    assert caplog.text.count("refused a connection to the control port") == 4


@pytest.mark.timeout(60)
def test_a_silent_peer_holds_nothing_up_and_is_dropped_after_the_auth_timeout():
    listener = ControlListener(auth_timeout=0.5)
    try:
        with socket.create_connection(listener.address, timeout=10) as silent:
            start = time.monotonic()
            challenge = b""
            while chunk := silent.recv(4096):  # the challenge, then the close
                challenge += chunk
            assert 0.4 < time.monotonic() - start < 5 and b"#CHALLENGE#" in challenge
        authkey = listener.authkey
        peer = threading.Thread(target=lambda: Client(listener.address, authkey=authkey).close())
        with socket.create_connection(listener.address):  # another silent peer, while one with the secret gets in
            peer.start()
            assert listener.accept(timeout=5) is not None
        peer.join()
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_junk_sent_to_the_workers_gloo_sockets_leaves_the_cluster_working(cluster):
    cluster.run(all_reduce)
    ports = [s[3] for s in listening(_pids(cluster))]
    assert ports
    for port in ports:
        for junk in (os.urandom(4096), pickle.dumps({"rank": 0}), b"\x00" * 64):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(junk)
    assert cluster.run(all_reduce) == [3.0, 3.0]
    assert cluster.status()["alive"].all()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: pip install 'rlkit[vllm]'")
@pytest.mark.timeout(600)
def test_nccl_and_vllm_on_gpus_listen_on_loopback_only():
    config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=4, group_size=2,
                              rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=4))
    with launch(2, device="cuda") as cluster:
        rlkit.Trainer(cluster, config).step()
        workers = _pids(cluster)
        sockets = listening(workers)
        assert all(any(s[0] == pid for s in sockets) for pid in workers)
        assert any(s[1].startswith("VLLM::") for s in sockets)
        assert beyond_loopback(sockets) == set()


# -- relaunching leaves nothing behind ---------------------------------------------------------

def _footprint() -> dict[str, object]:
    """What this process holds that a cluster could leak."""
    me = psutil.Process()
    return {"children": sorted(p.pid for p in me.children(recursive=True)), "fds": me.num_fds(),
            "threads": sorted(t.name for t in threading.enumerate())}


def _left_on_disk(cluster_id: str) -> list[str]:
    """A cluster's shared-memory files, private directory and log folder (removed at a clean shutdown)."""
    return [p for pattern in (f"/dev/shm/rlkit-{cluster_id}-*", f"{tempfile.gettempdir()}/rlkit-{cluster_id}-*")
            for p in glob.glob(pattern)]


def _cycle(index: int) -> rlkit.runtime.Cluster:
    """Launch (replacing the previous cluster, or after it was shut down), move tensors both ways
    and all-reduce; every other cluster is shut down here, the others by the next launch."""
    cluster = launch(2, device="cpu")
    big = torch.randn(256, 1024)  # through shared memory both ways
    assert all(torch.equal(out, big * 2) for out in cluster.run(lambda x: x * 2, big))
    assert cluster.run(all_reduce) == [3.0, 3.0]
    if index % 2:
        cluster.shutdown()
    return cluster


@pytest.mark.timeout(180)
def test_relaunch_cycles_leave_no_processes_fds_threads_or_shared_memory():
    _cycle(1)  # warm-up (lazily started threads, imports); it also replaces the module's cluster
    before = _footprint()
    clusters = [_cycle(index) for index in range(4)]
    clusters[-1].shutdown()
    assert _footprint() == before
    assert [p for c in clusters for p in _left_on_disk(c.id)] == []
