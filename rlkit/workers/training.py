"""Runs on every rank: a model being trained (FSDP-wrapped, AdamW built after wrapping, schedule), its checkpoint."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlkit.config import FSDPConfig, OptimConfig
from rlkit.fsdp import apply_fsdp, clip_grad_norm
from rlkit.fsdp.accumulate import accumulation
from rlkit.fsdp.checkpoint import load_sharded, save_sharded
from rlkit.workers.optim import build_optimizer

T = TypeVar("T")


@dataclass
class TrainedModel:
    """This rank's shard of a trained model, its optimizer and schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reshard_after_forward: bool = True
    """The wrapping's ``fsdp.reshard_after_forward``."""
    keep_unsharded: bool = False
    """Keep FSDP's units gathered and the gradients unsharded through an optimizer step's micro-batches
    (:func:`accumulation`); the role sets it where the memory estimate says it fits."""
    steps_begun: int = 0
    """Optimizer steps begun on these weights (one stopped inside AdamW's loop counts): they moved when it grows."""

    @classmethod
    def build(
        cls, model: torch.nn.Module, mesh: DeviceMesh, fsdp: FSDPConfig, optim: OptimConfig, total_steps: int
    ) -> TrainedModel:
        """Shard ``model`` with FSDP, then build AdamW over the sharded parameters and a schedule of ``total_steps``."""
        wrapped = apply_fsdp(model, mesh, fsdp)
        trained = [p for p in wrapped.parameters() if p.requires_grad]  # LoRA: the adapters only
        optimizer, scheduler = build_optimizer(trained, optim, total_steps)
        return cls(wrapped, optimizer, scheduler, reshard_after_forward=fsdp.reshard_after_forward)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def accumulation(self, micro_batches: Sequence[T]) -> AbstractContextManager[Iterator[T]]:
        """``with model.accumulation(micros) as steps: for micro in steps: ...``: one optimizer step's micro-batches,
        with FSDP's gathers and reductions once per step where :attr:`keep_unsharded` (rlkit.fsdp.accumulate)."""
        return accumulation(self.model, micro_batches, keep_unsharded=self.keep_unsharded,
                            reshard_after_forward=self.reshard_after_forward)

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clip the gradients by their true global norm over all ranks, then the optimizer and schedule step.

        A non-finite norm (an inf or NaN anywhere, on any rank) skips the optimizer step on every rank alike (the
        norm is the same on all): the weights and AdamW's moments stay as they were; the schedule still moves.
        Returns the norm before clipping (the same on every rank)."""
        norm = clip_grad_norm(self.model, max_grad_norm)
        if math.isfinite(norm):
            self.steps_begun += 1
            self.optimizer.step()
        self.scheduler.step()
        return norm

    def save(self, directory: Path, name: str, rank: int) -> None:
        """Shards of model and optimizer into ``directory/name``; this rank's schedule into ``name_rank<r>.pt``.

        Before the first optimizer step, torch's checkpointing fills AdamW's state by a step with zero gradients and
        lr 0, which counts as a step (the next real one would see step 2 and a different bias correction): that
        state is dropped again after the save, so saving never changes training."""
        fresh = not self.optimizer.state
        save_sharded(self.model, self.optimizer, directory / name)
        if fresh:
            self.optimizer.state.clear()
        torch.save({"scheduler": self.scheduler.state_dict()}, directory / f"{name}_rank{rank}.pt")

    def load(self, directory: Path, name: str, rank: int) -> None:
        load_sharded(self.model, self.optimizer, directory / name)
        state = torch.load(directory / f"{name}_rank{rank}.pt", weights_only=True)
        self.scheduler.load_state_dict(state["scheduler"])
