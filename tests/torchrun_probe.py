"""Run under torchrun by tests/test_torchrun.py: ``torchrun --standalone --nproc_per_node=2 tests/torchrun_probe.py
OUT.json [die]``. Rank 0 drives a cluster of both ranks through the torchrun backend and writes what it saw to
OUT.json (a forged, unsigned call to rank 1 included); with "die", rank 1 kills itself in the middle of a call
instead. Rank 1 acts as if it ran on another
node (it does not see the controller's shared memory), so its tensors travel through torchrun's store while
rank 0's travel in shared-memory files."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.runtime import PerRank, RemoteError, WorkerHung, context, torchrun
from rlkit.runtime.cluster import Cluster
from tests.test_runtime_exposure import beyond_loopback, listening

BIG = 3 * 2**20  # float32 elements: 12 MiB, more than two of the store channel's chunks


def double_and_reduce(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    total = torch.tensor(float(t.numel()))
    dist.all_reduce(total)
    return 2 * t, total.item()


def fail_on_rank_1() -> None:
    if context().rank == 1:
        raise ValueError("rank 1 says no")


def hang_on_rank_1() -> None:
    if context().rank == 1:
        time.sleep(600)


def die_on_rank_1() -> None:
    if context().rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


class Touch:
    """Unpickling it creates ``path``: what anyone reaching torchrun's store could run on a rank, unsigned."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def forge_a_call_to_rank_1(cluster: Cluster, pwned: Path) -> bool:
    """Write, as someone who reaches MASTER_PORT and knows the run id but not the secret, a pickle under the key
    rank 1 reads its next call from; True once rank 1 has refused (deleted) it, within 10 s."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    run = f"{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    forger = dist.PrefixStore(f"rlkit/{run}/", store)
    key = f"in/1/{cluster._backend._sent[1]}"
    forger.set(f"{key}/0/0", pickle.dumps(Touch(pwned)))  # type: ignore[arg-type]
    forger.set(key, pickle.dumps([1]))  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while forger.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not forger.check([key])


def probe(cluster: Cluster) -> dict:
    seen: dict = {"world_size": cluster.world_size, "device": cluster.device}
    seen["ranks"] = cluster.run(lambda: (context().rank, context().world_size, os.getpid()))
    big = torch.arange(BIG, dtype=torch.float32)
    results = cluster.run(double_and_reduce, PerRank([torch.ones(5), big]))
    seen["doubled"] = torch.equal(results[0][0], 2 * torch.ones(5)) and torch.equal(results[1][0], 2 * big)
    shared = cluster.run(double_and_reduce, -big)  # one tensor for both ranks
    seen["doubled"] &= all(torch.equal(r[0], -2 * big) for r in shared)
    seen["shares_memory"] = [row["shares_memory"] for row in cluster._backend._infos]
    seen["reduced"] = [r[1] for r in results]
    try:
        cluster.run(fail_on_rank_1)
    except RemoteError as exc:
        seen["error"] = str(exc)
    cluster.hang_timeout = 2.0
    try:
        cluster.run(hang_on_rank_1)
    except WorkerHung as exc:
        seen["hung"] = {"ranks": exc.ranks, "broken": exc.cluster_broken, "stack": exc.stacks[1]}
    seen["after_hang"] = cluster.run(lambda: context().rank)
    pwned = Path(f"{sys.argv[1]}.pwned")
    seen["forgery_refused"] = forge_a_call_to_rank_1(cluster, pwned)
    seen["pwned"] = pwned.exists()
    seen["after_forgery"] = cluster.run(lambda: context().rank)
    status = cluster.status()
    seen["status"] = status[["rank", "alive", "device"]].to_dict("records")
    seen["exposed"] = sorted(map(list, beyond_loopback(listening(status["pid"].tolist()))))
    return seen


def main() -> int:
    if torchrun.rank() > 0:
        torchrun.shares_memory = lambda probe: False  # as on another node
        return torchrun.serve()
    out, action = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "probe"
    if action == "die":
        torchrun.run_controller(lambda cluster: cluster.run(die_on_rank_1), device="cpu")
        return 0
    seen = torchrun.run_controller(probe, device="cpu")
    with open(out, "w") as f:
        json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
