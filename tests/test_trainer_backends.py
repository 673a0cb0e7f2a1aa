"""The same short GRPO run on the local and on the Ray backend: every rank's weights move, ranks
agree, the rollout engine gets the new weights, and both backends compute the same run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import rlkit
from tests.test_trainer import TINY, full_weights

RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray: pip install '.[ray]'")


@pytest.fixture(scope="module")
def histories():
    """reward/mean of each backend's run, to compare the backends."""
    return {}


@pytest.fixture
def backend(request):
    if request.param == "ray":
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield "ray"
        ray.shutdown()
    else:
        yield request.param


@pytest.fixture
def cluster(backend, request):
    """The backend's 2-rank CPU cluster: the session's (tests/conftest.py) for local, a fresh one for Ray."""
    if backend == "local":
        yield request.getfixturevalue("cpu_cluster")
    else:
        with rlkit.launch(world_size=2, backend=backend, device="cpu") as ray_cluster:
            yield ray_cluster


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=RAY)], indirect=True)
def test_short_fit_updates_every_rank_and_ranks_agree(backend, cluster, histories):
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**TINY, optim=rlkit.OptimConfig(lr=1e-3)))
    before = cluster.run(full_weights, "actor")
    history = trainer.fit(steps=2, progress=False)
    after = cluster.run(full_weights, "actor")
    engines = cluster.run(full_weights, "engine")
    assert len(history) == 2 and history["actor/grad_norm"].max() > 0  # weight_decay is 0: only gradients move weights
    for name in before[0]:
        for rank in range(2):
            assert not torch.equal(before[rank][name], after[rank][name]), f"{name} unchanged on rank {rank}"
        assert torch.equal(after[0][name], after[1][name]), f"ranks disagree on {name}"
        assert torch.equal(engines[1][name], after[1][name]), f"weight sync missed {name}"
    histories[backend] = history["reward/mean"].tolist()
    if len(histories) == 2:
        assert histories["local"] == histories["ray"], "the backends computed different runs"
