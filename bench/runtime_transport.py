"""Controller <-> worker cost per backend: empty SPMD call round trip and tensor-batch transfer rate
(figures, not a test).

    python bench/runtime_transport.py [--world-size 2] [--mb 256] [--calls 50] [--repeats 3]
    torchrun --standalone --nproc_per_node=2 bench/runtime_transport.py [--mb 256] ...   # the torchrun backend

The batch is one float32 tensor of ``--mb`` MB split across the ranks (``PerRank``, as the
trainer sends its batches); each rank returns its part, so ``2 x mb`` MB cross per call. The rate
is that over the median wall time of ``--repeats`` calls. The Ray backend runs if Ray is
installed (a single-node Ray instance is started for it); the last lines are local/ray ratios.
Under torchrun only the torchrun backend runs (its "launch" is the workers joining, after torchrun
started them).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from functools import partial

import torch

import rlkit
from rlkit.runtime import Cluster, PerRank, torchrun


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def measure(backend: str, world_size: int, mb: int, calls: int, repeats: int) -> dict[str, float]:
    """Median seconds of an empty call, and MB/s of a batch sent out and back."""
    start = time.perf_counter()
    if backend == "torchrun":
        return torchrun.run_controller(partial(_measure, start, mb, calls, repeats), device="cpu")
    with rlkit.launch(world_size=world_size, backend=backend, device="cpu") as cluster:
        return _measure(start, mb, calls, repeats, cluster)


def _measure(start: float, mb: int, calls: int, repeats: int, cluster: Cluster) -> dict[str, float]:
    launched = time.perf_counter() - start
    cluster.run(lambda: None)  # warm-up
    empty = []
    for _ in range(calls):
        t = time.perf_counter()
        cluster.run(lambda: None)
        empty.append(time.perf_counter() - t)
    batch = torch.randn(mb * 2**20 // 4)
    parts = PerRank(list(batch.chunk(cluster.world_size)))
    transfer = []
    for _ in range(repeats):
        t = time.perf_counter()
        cluster.run(_echo, parts)
        transfer.append(time.perf_counter() - t)
    seconds = statistics.median(transfer)
    return {"launch_s": launched, "empty_call_ms": 1e3 * statistics.median(empty),
            "batch_s": seconds, "batch_MB_per_s": 2 * mb / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if torchrun.launched() and torchrun.rank() > 0:
        sys.exit(torchrun.serve())
    if torchrun.launched():
        backends, args.world_size = ["torchrun"], torchrun.world_size()
    else:
        backends = ["local"] + (["ray"] if importlib.util.find_spec("ray") else [])
    results = {b: measure(b, args.world_size, args.mb, args.calls, args.repeats) for b in backends}
    print(f"{args.world_size} ranks on CPU; batch {args.mb} MB split across ranks, out and back")
    print(f"{'backend':<9}{'launch s':>10}{'empty call ms':>15}{'batch s':>10}{'batch MB/s':>12}")
    for backend, r in results.items():
        print(f"{backend:<9}{r['launch_s']:>10.1f}{r['empty_call_ms']:>15.2f}{r['batch_s']:>10.3f}"
              f"{r['batch_MB_per_s']:>12.0f}")
    if "ray" in results:
        local, ray = results["local"], results["ray"]
        print(f"local/ray: empty call time {local['empty_call_ms'] / ray['empty_call_ms']:.2f}x, "
              f"batch transfer rate {local['batch_MB_per_s'] / ray['batch_MB_per_s']:.2f}x")
    elif "local" in results:
        print("ray is not installed (pip install '.[ray]'): no Ray figures")


if __name__ == "__main__":
    main()
