"""rlkit.runtime on CPU: 2 gloo workers started as fresh processes."""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from rlkit.runtime import (
    ClusterBroken,
    PerRank,
    RemoteError,
    WorkerDied,
    WorkerHung,
    context,
    launch,
)
from rlkit.runtime.cluster import STATUS_COLUMNS
from rlkit.runtime.transport import TensorFiles, dumps, loads

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def _holder():
    """Keeps one cluster for the module; tests that break it get a new one from ``cluster``."""
    holder: dict = {}
    yield holder
    if "cluster" in holder:
        holder["cluster"].shutdown()


@pytest.fixture
def cluster(_holder):
    if "cluster" not in _holder or _holder["cluster"].closed:
        _holder["cluster"] = launch(2, device="cpu")
    return _holder["cluster"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(cluster) -> list[int]:
    return cluster.status().pid.tolist()


def _shm_files(cluster) -> list[str]:
    return glob.glob(f"/dev/shm/rlkit-{cluster.id}-*")


# -- no workers needed -------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend='mpi': valid backends are 'local', 'ray'"):
        launch(2, backend="mpi")
    with pytest.raises(ValueError, match="valid devices"):
        launch(2, device="tpu")
    with pytest.raises(ValueError, match="world_size"):
        launch(0)
    with pytest.raises(ValueError) as info:  # every problem at once
        launch(2, address="auto", hang_timeout=0, call_timeout=-1.0)
    assert "address='auto' is for backend='ray'" in str(info.value)
    assert "hang_timeout must be positive seconds, got 0" in str(info.value)
    assert "call_timeout must be positive seconds, got -1.0" in str(info.value)


@pytest.mark.timeout(10)
def test_context_outside_a_worker_raises():
    with pytest.raises(RuntimeError, match="only available inside"):
        context()


@pytest.mark.timeout(10)
def test_transport_moves_tensor_data_out_of_the_pickle(tmp_path):
    big = torch.randn(1024, 1024)
    files = TensorFiles(f"{tmp_path}/t-", reader_unlinks=False)
    first, second = dumps((big, 1), files), dumps([big], files)
    assert len(first) < 1024 and len(files.paths) == 1  # written once, shared by both messages
    assert torch.equal(loads(first)[0], big) and torch.equal(loads(second)[0], big)
    files.remove()
    assert list(tmp_path.iterdir()) == []
    files = TensorFiles(f"{tmp_path}/r-", reader_unlinks=True)
    assert torch.equal(loads(dumps(big, files)), big)
    assert list(tmp_path.iterdir()) == []  # the reader unlinked it


# -- one shared cluster ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_run_returns_one_result_per_rank_in_rank_order(cluster):
    assert cluster.world_size == 2 and cluster.device == "cpu"
    assert cluster.run(lambda: context().rank) == [0, 1]
    assert cluster.run(lambda a, b: a + b, 1, b=2) == [3, 3]
    ctx = cluster.run(context)[1]
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend) == (1, 2, 1, "gloo")
    assert ctx.device == torch.device("cpu")
    assert cluster.run(lambda: (os.environ["RANK"], os.environ["WORLD_SIZE"]))[1] == ("1", "2")
    assert cluster.run(torch.get_num_threads) == [max(1, os.cpu_count() // 2)] * 2


@pytest.mark.timeout(60)
def test_per_rank_splits_arguments(cluster):
    out = cluster.run(lambda x, y: (x, y), PerRank(["a", "b"]), y=PerRank([10, 20]))
    assert out == [("a", 10), ("b", 20)]


@pytest.mark.timeout(60)
def test_per_rank_of_wrong_length_raises_before_sending(cluster):
    def count_call():
        state = context().state
        state["per_rank_calls"] = state.get("per_rank_calls", 0) + 1

    with pytest.raises(ValueError, match="PerRank for argument 0 has 3 items.*world_size=2"):
        cluster.run(lambda x: count_call(), PerRank([1, 2, 3]))
    assert cluster.run(lambda: context().state.get("per_rank_calls", 0)) == [0, 0]


@pytest.mark.timeout(60)
def test_closures_and_lambdas_travel_by_value(cluster):
    factor = 3

    def times(x):
        return x * factor

    assert cluster.run(times, 2) == [6, 6]
    assert cluster.run(lambda: factor + 1) == [4, 4]


@pytest.mark.timeout(60)
def test_unpicklable_argument_raises_clear_error_and_cluster_survives(cluster):
    with pytest.raises(pickle.PicklingError, match=r"argument 0 \(_thread.lock\).*cannot pickle"):
        cluster.run(lambda lock: None, threading.Lock())
    assert cluster.run(lambda: "ok") == ["ok", "ok"]


@pytest.mark.timeout(60)
def test_unpicklable_result_raises_remote_error(cluster):
    with pytest.raises(RemoteError, match="cannot be sent back"):
        cluster.run(threading.Lock)
    assert cluster.run(lambda: 1) == [1, 1]


@pytest.mark.timeout(60)
def test_tensors_round_trip_exactly_both_ways(cluster):
    tensors = {
        "float32": torch.randn(4, 5),
        "bfloat16": torch.randn(300, 200).to(torch.bfloat16),
        "bool": torch.rand(70_000) > 0.5,
        "int64": torch.arange(-50_000, 50_000),
        "non_contiguous": torch.randn(300, 400).t()[::2],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "requires_grad": torch.randn(100, 200, requires_grad=True),
        "64MB": torch.randn(16 * 1024 * 1024),
    }

    def echo(received: dict) -> dict:
        made_here = {"grad": torch.ones(50_000, requires_grad=True) * 2}
        return {**received, **made_here}

    for result in cluster.run(echo, tensors):
        assert result.keys() == {*tensors, "grad"}
        for name, sent in tensors.items():
            got = result[name]
            assert got.dtype == sent.dtype and got.shape == sent.shape, name
            assert torch.equal(got, sent.detach()), name
            assert not got.requires_grad, name
        assert torch.equal(result["grad"], torch.full((50_000,), 2.0))
        assert not result["grad"].requires_grad
    assert _shm_files(cluster) == []


@pytest.mark.timeout(60)
def test_all_reduce_and_state_that_persists_between_calls(cluster):
    def step():
        ctx = context()
        ctx.state["steps"] = ctx.state.get("steps", 0) + 1
        t = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(t)
        return t.item(), ctx.state["steps"]

    assert cluster.run(step) == [(3.0, 1), (3.0, 1)]
    assert cluster.run(step) == [(3.0, 2), (3.0, 2)]


@pytest.mark.timeout(60)
def test_exception_on_one_rank_names_it_with_remote_traceback(cluster):
    def explode_on_worker():
        raise ValueError("boom on purpose")

    def fn():
        if context().rank == 1:
            explode_on_worker()
        return "fine"

    with pytest.raises(RemoteError) as info:
        cluster.run(fn)
    message = str(info.value)
    assert info.value.ranks == [1]
    assert "rank 1 (host" in message and "device cpu" in message
    assert "ValueError: boom on purpose" in message
    assert "explode_on_worker" in message and "Traceback" in message
    assert "rank 0" not in message
    assert cluster.run(lambda: "again") == ["again", "again"]


@pytest.mark.timeout(60)
def test_several_failed_ranks_are_all_named(cluster):
    def fn():
        raise KeyError(f"rank{context().rank}")

    with pytest.raises(RemoteError) as info:
        cluster.run(fn)
    assert info.value.ranks == [0, 1]
    assert "rank 0 (host" in str(info.value) and "also rank 1 (host" in str(info.value)


@pytest.mark.timeout(60)
def test_worker_output_is_forwarded_with_prefix_and_logged(cluster, capsys):
    cluster.run(lambda: print(f"hello from rank {context().rank}"))
    out = capsys.readouterr().out
    assert "[rank 1] hello from rank 1" in out and "[rank 0] hello from rank 0" in out
    assert "hello from rank 1" in (cluster.log_dir / "rank1.log").read_text()


QUIET = [
    "(Worker pid=27818) WARNING 12-02 06:32:34 [layerwise.py:266] ParallelLMHead: Failed to load weights",
    "(EngineCore pid=27375) INFO 12-02 06:31:28 [core.py:133] Initializing a V1 LLM engine (v0.32.0)",
    "INFO rlkit.runtime.roles: PolicyWorker ready",
    "/usr/lib/python3.11/site-packages/vllm/x.py:138: FutureWarning: `reduce_op` is deprecated",
    "  if hasattr(value, '__dict__'):",
    "W1202 06:32:24.488000 27818 torch/_library/triton.py:53] Triton not available",
    "[rank0]:W1202 10:20:08.851000 8264 torch/_library/triton.py:53] Triton not available, find_triton_kernels = []",
    "Loading safetensors checkpoint shards:   0% Completed\rLoading safetensors checkpoint shards: 100% Completed",
]
"""Worker lines that stay in the rank log: vLLM's own log lines, rlkit's info notes, a library's warning with
its source line, torch's glog-style warnings, a progress bar."""


def test_a_verbose_forwarder_forwards_every_line(tmp_path, capsys):
    from rlkit.runtime.logs import OutputForwarder

    for verbose in (True, False):
        forwarder = OutputForwarder(verbose=verbose)
        forwarder.add(0, tmp_path / f"verbose-{verbose}.log")
        forwarder.feed(0, [line + "\n" for line in QUIET])
        assert capsys.readouterr().out.count("[rank 0] ") == (len(QUIET) if verbose else 0)


@pytest.mark.timeout(60)
def test_vllm_and_library_noise_stays_in_the_rank_log(cluster, capsys):
    def noisy():
        for line in [*QUIET, "(EngineCore pid=1) ERROR 12-02 06:32:40 [core.py:1] the engine died", "my own line"]:
            print(line, flush=True)

    cluster.run(noisy)
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("[rank 0]")] == [
        "[rank 0] (EngineCore pid=1) ERROR 12-02 06:32:40 [core.py:1] the engine died", "[rank 0] my own line"]
    assert all(line in (cluster.log_dir / "rank0.log").read_text() for line in QUIET[:-1])


@pytest.mark.timeout(60)
def test_worker_output_is_rate_limited_but_fully_logged(cluster, capsys):
    def flood():
        for i in range(500):
            print(f"flood line {i}")

    cluster.run(flood)
    out = capsys.readouterr().out
    forwarded = [line for line in out.splitlines() if line.startswith("[rank 0] flood line")]
    assert 0 < len(forwarded) < 200
    assert "lines dropped, see" in out and str(cluster.log_dir / "rank0.log") in out
    assert (cluster.log_dir / "rank0.log").read_text().count("flood line") == 500


@pytest.mark.timeout(60)
def test_status_has_documented_columns(cluster):
    time.sleep(1.2)  # let a heartbeat arrive
    status = cluster.status()
    assert list(status.columns) == STATUS_COLUMNS
    assert status["rank"].tolist() == [0, 1] and status["alive"].all()
    assert not status["busy"].any() and (status["device"] == "cpu").all()
    assert (status["heartbeat_age_s"] < 5).all() and (status["rss_mb"] > 10).all()


@pytest.mark.timeout(60)
def test_keyboard_interrupt_cancels_the_call_quickly_and_cluster_stays_usable(cluster, interrupt_after):
    pids = _pids(cluster)
    cluster.run(lambda: context().state.update(kept=context().rank))

    def work():
        context().state["started"] = True
        time.sleep(30)
        context().state["finished"] = True

    fired = interrupt_after(1.0)
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.run(work)
    assert time.monotonic() - fired["at"] < 5
    assert "cancelled on ranks [0, 1]; the cluster is still usable" in "".join(info.value.__notes__)
    assert not cluster.closed and _pids(cluster) == pids
    state = cluster.run(lambda: dict(context().state))
    assert [(s["kept"], s["started"], "finished" in s) for s in state] == [(0, True, False), (1, True, False)]

    def all_reduce():
        t = torch.tensor([context().rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    assert cluster.run(all_reduce) == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_call_timeout_cancels_a_slow_call_and_cluster_stays_usable(cluster):
    cluster.call_timeout = 1.0

    def slow():
        time.sleep(30)

    try:
        start = time.monotonic()
        with pytest.raises(WorkerHung, match="cancelled on every rank; the cluster is still usable") as info:
            cluster.run(slow)
        assert time.monotonic() - start < 1.0 + 5
        assert info.value.ranks == [0, 1] and not info.value.cluster_broken
        assert all("in slow\n    time.sleep(30)" in info.value.stacks[r] for r in (0, 1))
    finally:
        cluster.call_timeout = None
    assert cluster.run(lambda: "ok") == ["ok", "ok"]


# -- tests that break their cluster ------------------------------------------------------------

@pytest.mark.timeout(60)
def test_keyboard_interrupt_with_a_rank_in_a_collective_shuts_down_quickly(cluster, interrupt_after):
    pids = _pids(cluster)

    def fn():
        if context().rank == 0:
            time.sleep(30)
        dist.barrier()  # rank 1 waits here for rank 0, in C++, where no signal reaches it

    fired = interrupt_after(1.5)
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.run(fn)
    assert time.monotonic() - fired["at"] < 5
    assert "ranks [1] did not stop" in "".join(info.value.__notes__)
    assert cluster.closed and _all_gone(pids)
    with pytest.raises(ClusterBroken, match="interrupted.*relaunch with rlkit.launch"):
        cluster.run(lambda: 1)


@pytest.mark.timeout(60)
def test_rank_stuck_in_a_collective_is_reported_with_its_stack_within_hang_timeout(cluster):
    cluster.hang_timeout = 2.0
    pids = _pids(cluster)

    def fn():
        if context().rank == 0:
            dist.barrier()  # rank 1 never enters it
        return context().rank

    start = time.monotonic()
    with pytest.raises(WorkerHung) as info:
        cluster.run(fn)
    assert time.monotonic() - start < 2.0 + 5
    assert info.value.ranks == [0] and info.value.cluster_broken
    assert "hang_timeout=2 s after rank 1 returned" in str(info.value)
    assert "dist.barrier()" in info.value.stacks[0] and "in fn" in info.value.stacks[0]
    assert _all_gone(pids)


@pytest.mark.timeout(60)
def test_all_ranks_stuck_are_reported_after_call_timeout(cluster):
    cluster.call_timeout = 2.0
    pids = _pids(cluster)

    def fn():
        peer = 1 - context().rank
        dist.recv(torch.empty(1), src=peer)  # both ranks wait for the other

    start = time.monotonic()
    with pytest.raises(WorkerHung, match=r"ranks \[0, 1\] hung: the call ran longer than call_timeout=2 s") as info:
        cluster.run(fn)
    assert time.monotonic() - start < 2.0 + 5
    assert all("dist.recv(" in info.value.stacks[r] for r in (0, 1))
    assert _all_gone(pids)


def _kill_rank_1_mid_call(cluster) -> WorkerDied:
    """SIGKILL rank 1 inside a call: WorkerDied names it within 10 s, every worker is gone and the
    cluster refuses further calls. Returns the error (each backend checks its own details)."""
    pids = _pids(cluster)

    def die_on_rank_1():
        if context().rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    start = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1") as info:
        cluster.run(die_on_rank_1)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and info.value.pid == pids[1]
    assert _all_gone(pids)
    with pytest.raises(ClusterBroken, match="cluster is broken.*relaunch with rlkit.launch"):
        cluster.run(lambda: 1)
    return info.value


@pytest.mark.timeout(60)
def test_killed_worker_raises_worker_died_quickly(cluster):
    error = _kill_rank_1_mid_call(cluster)
    assert "SIGKILL" in str(error)
    assert _shm_files(cluster) == []


@pytest.mark.timeout(60)
def test_ranks_stuck_after_another_rank_failed_break_the_cluster(cluster):
    cluster.hang_timeout = 1.0
    pids = _pids(cluster)

    def fn():
        if context().rank == 1:
            raise RuntimeError("rank 1 gives up")
        dist.barrier()  # never completes: rank 1 is gone from the collective

    with pytest.raises(RemoteError) as info:
        cluster.run(fn)
    message = str(info.value)
    assert info.value.ranks == [1] and "RuntimeError: rank 1 gives up" in message
    assert "Ranks [0] still running hang_timeout=1 s after rank 1 raised" in message
    assert "cluster was shut down" in message and "dist.barrier()" in message
    assert _all_gone(pids)


@pytest.mark.timeout(90)
def test_a_rank_that_abandons_a_collective_ends_the_call_at_once_and_restart_brings_fresh_workers(cluster):
    from rlkit.runtime.errors import CollectiveAbandoned

    cluster.hang_timeout = 120.0  # not what ends the call
    pids = _pids(cluster)

    def fn():
        if context().rank == 1:
            raise CollectiveAbandoned("RuntimeError: rank 1 gives up in the forward")
        dist.barrier()  # rank 1 never enters it

    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        cluster.run(fn)
    assert time.monotonic() - started < 15
    assert info.value.ranks == [1] and "rank 1 gives up in the forward" in str(info.value)
    assert "rank 1 raised where they wait in its collectives (CollectiveAbandoned)" in str(info.value)
    cluster.restart()
    assert cluster.broken is None and not cluster.closed
    fresh = cluster.run(os.getpid)
    assert set(fresh).isdisjoint(pids) and _all_gone(pids)
    assert cluster.run(lambda: dist.all_reduce(torch.ones(1)) or 2) == [2, 2]  # a process group again
    cluster.shutdown()  # on purpose: not broken
    assert cluster.broken is None and cluster.closed
    with pytest.raises(ClusterBroken, match="shut down"):
        cluster.run(os.getpid)


@pytest.mark.timeout(60)
def test_launch_replaces_earlier_cluster_and_shutdown_is_idempotent(tmp_path, caplog):
    first = launch(2, device="cpu")
    first_pids = _pids(first)
    with pytest.raises(RemoteError) as failed:
        first.run(lambda: 1 / 0)
    assert f"Worker logs: {first.log_dir}" in "".join(failed.value.__notes__)
    threads = 1 if os.cpu_count() // 2 >= 2 else 2  # not the default share of the cores
    second = launch(2, device="cpu", log_dir=tmp_path, env={"OMP_NUM_THREADS": str(threads)})
    assert first.closed and _all_gone(first_pids)
    assert (first.log_dir / "rank0.log").exists() and f"worker logs kept in {first.log_dir}" in caplog.text
    shutil.rmtree(first.log_dir)  # a clean shutdown removes its own (tests/test_runtime_exposure.py)
    assert second.run(torch.get_num_threads) == [threads, threads]
    assert second.log_dir == tmp_path and (tmp_path / "rank1.log").exists()
    second_pids = _pids(second)
    second.shutdown()
    assert _all_gone(second_pids, timeout=0.1)
    second.shutdown()
    assert not second.status()["alive"].any()


@pytest.mark.timeout(30)
def test_launch_timeout_raises_and_leaves_no_worker(tmp_path):
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not connect"):
        launch(2, device="cpu", timeout=0.3, log_dir=tmp_path)
    workers = [p for p in psutil.Process().children(recursive=True)
               if "rlkit.runtime.worker" in " ".join(p.cmdline())]
    assert _all_gone([p.pid for p in workers], timeout=5)


@pytest.mark.timeout(60)
def test_workers_die_with_their_controller():
    code = ("import json, time\nfrom rlkit.runtime import launch\nc = launch(2, device='cpu')\n"
            "print(json.dumps(c.status().pid.tolist()), flush=True)\ntime.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    controller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        pids = json.loads(controller.stdout.readline())
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        controller.kill()
        controller.wait()
    assert _all_gone(pids, timeout=10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(120)
def test_cuda_workers_use_nccl_and_return_cuda_tensors_on_the_cpu():
    with launch(2, device="auto") as cluster:
        assert cluster.device == "cuda"
        assert cluster.status()["device"].tolist() == ["cuda:0", "cuda:1"]

        def fn(x):
            ctx = context()
            t = torch.full((4,), ctx.rank + 1.0, device=ctx.device)
            dist.all_reduce(t)
            big = torch.arange(1 << 20, device=ctx.device) + ctx.rank
            return ctx.backend, torch.cuda.current_device(), t, x.to(ctx.device).sum().item(), big

        for rank, (backend, current, t, total, big) in enumerate(cluster.run(fn, torch.ones(500, 500))):
            assert (backend, current, total) == ("nccl", rank, 250_000.0)
            assert t.device.type == "cpu" and t.tolist() == [3.0] * 4
            assert big.device.type == "cpu" and torch.equal(big, torch.arange(1 << 20) + rank)
