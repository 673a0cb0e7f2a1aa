"""rlkit.runtime's Ray backend on CPU: 2 gloo ranks as Ray actors on a single-node Ray instance
that this module starts (no dashboard; Ray's token authentication, on by default, refuses peers
without the token). Skipped where Ray is not installed (``pip install '.[ray]'``)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from rlkit.runtime import (
    PerRank,
    WorkerHung,
    context,
    launch,
)
from rlkit.runtime.cluster import STATUS_COLUMNS
from tests.test_runtime import _all_gone, _kill_rank_1_mid_call, _pids

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this machine only: no dashboard, 2 CPUs."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def _holder(local_ray):
    holder: dict = {}
    yield holder
    if "cluster" in holder:
        holder["cluster"].shutdown()


@pytest.fixture
def cluster(_holder):
    if "cluster" not in _holder or _holder["cluster"].closed:
        _holder["cluster"] = launch(2, backend="ray", device="cpu")
    return _holder["cluster"]


@pytest.mark.timeout(120)
def test_ray_cluster_runs_spmd_calls_with_tensors_output_and_status(cluster, capsys):
    assert cluster.world_size == 2 and cluster.device == "cpu"
    node_address = ray.nodes()[0]["NodeManagerAddress"]  # rendezvous at rank 0's node
    assert cluster.run(lambda: os.environ["MASTER_ADDR"]) == [node_address] * 2
    big = torch.randn(512, 1024)  # 2 MiB: through the object store

    def fn(shared, mine):
        ctx = context()
        t = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(t)
        print(f"hello from rank {ctx.rank}")
        return ctx.rank, ctx.backend, t.item(), shared * 2, mine + 1

    out = cluster.run(fn, big, PerRank([torch.zeros(100_000), torch.ones(3, dtype=torch.bfloat16)]))
    assert [o[:3] for o in out] == [(0, "gloo", 3.0), (1, "gloo", 3.0)]
    assert all(torch.equal(o[3], big * 2) for o in out)
    assert torch.equal(out[0][4], torch.ones(100_000))
    assert out[1][4].dtype == torch.bfloat16 and out[1][4].tolist() == [2.0] * 3
    printed = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in printed and "[rank 1] hello from rank 1" in printed
    assert "hello from rank 1" in (cluster.log_dir / "rank1.log").read_text()
    status = cluster.status()
    assert list(status.columns) == STATUS_COLUMNS and status["alive"].all()
    assert (status["heartbeat_age_s"] < 5).all() and (status["rss_mb"] > 10).all()
    assert len(set(status["pid"]) | {os.getpid()}) == 3


@pytest.mark.timeout(120)
def test_ray_keyboard_interrupt_cancels_the_call_and_cluster_stays_usable(cluster, interrupt_after):
    pids = _pids(cluster)
    fired = interrupt_after(1.0)
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.run(time.sleep, 30)
    assert time.monotonic() - fired["at"] < 5
    assert "the cluster is still usable" in "".join(info.value.__notes__)
    assert _pids(cluster) == pids and cluster.run(lambda: context().rank) == [0, 1]


@pytest.mark.timeout(120)
def test_ray_ranks_stuck_in_a_collective_are_reported_after_call_timeout(cluster):
    cluster.call_timeout = 2.0
    pids = _pids(cluster)

    def fn():
        dist.recv(torch.empty(1), src=1 - context().rank)  # both ranks wait for the other

    start = time.monotonic()
    with pytest.raises(WorkerHung) as info:
        cluster.run(fn)
    assert time.monotonic() - start < 2.0 + 6
    assert info.value.ranks == [0, 1] and info.value.cluster_broken
    assert all("dist.recv(" in info.value.stacks[r] for r in (0, 1))
    assert _all_gone(pids)


@pytest.mark.timeout(120)
def test_ray_killed_actor_raises_worker_died_naming_the_rank(cluster):
    _kill_rank_1_mid_call(cluster)
