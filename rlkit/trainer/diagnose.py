"""What ``trainer.sharding() / memory() / grad_norms() / lint()`` run on the workers, and how they combine."""

from __future__ import annotations

import pandas as pd
from torch import nn

from rlkit import diagnostics
from rlkit.runtime import Cluster, context
from rlkit.trainer.policy_worker import STATE_KEY, PolicyWorker


def _worker() -> PolicyWorker:
    return context().state[STATE_KEY]


def _inspect() -> diagnostics.RankReport:
    """On a worker: the actor with its optimizer; the reference and the rollout engine's model as others."""
    worker = _worker()
    others = {} if worker.reference is None else {"reference": worker.reference}
    engine = getattr(worker.engine, "model", None)
    if isinstance(engine, nn.Module):
        others["engine"] = engine
    return diagnostics.inspect(worker.actor.model, worker.actor.optimizer, others=others)


def _marks() -> list[diagnostics.MemoryMark]:
    return _worker().memory.marks


def _grads() -> diagnostics.GradReport | None:
    return _worker().actor.grads


def sharding(cluster: Cluster) -> diagnostics.Sharding:
    return diagnostics.sharding(cluster.run(_inspect))


def lint(cluster: Cluster) -> diagnostics.Findings:
    return diagnostics.lint(cluster.run(_inspect))


def memory(cluster: Cluster) -> pd.DataFrame:
    return diagnostics.memory_table(cluster.run(_marks))


def grad_norms(cluster: Cluster) -> diagnostics.GradNorms:
    reports = cluster.run(_grads)
    if any(r is None for r in reports):
        raise RuntimeError("no update has run yet: call trainer.update(batch) or trainer.step() first")
    return diagnostics.grad_norms(reports)
