"""Runs on every rank: what every role that trains the policy holds, the FSDP actor and the frozen reference.

:class:`ActorRole` is the base of :class:`~rlkit.workers.policy.PolicyWorker` (RL, with a rollout
engine) and :class:`~rlkit.workers.preference.PreferenceWorker` (DPO, KTO). It owns the diagnostics
the controller reads (``inspect``, ``memory_marks``, ``grad_report``) and the actor's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlkit import diagnostics
from rlkit.config import FSDPConfig, LoraConfig, OptimConfig
from rlkit.fsdp import apply_fsdp, build_mesh, param_dtype
from rlkit.fsdp.checkpoint import export_hf, write_hf
from rlkit.models import load_causal_lm
from rlkit.models.lora import LoraBinding, adapters_disabled, apply_lora
from rlkit.runtime import Role, context
from rlkit.workers.lora import engine_weights, export_adapter
from rlkit.workers.phases import PhaseClock
from rlkit.workers.training import TrainedModel


class ActorRole(Role):
    """One rank's shard of the trained policy (with AdamW and schedule) and, if asked, of a frozen reference."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int,
        fsdp: FSDPConfig,
        optim: OptimConfig,
        optimizer_steps: int,
        reference: bool,
        trust_remote_code: bool,
        attn_implementation: str = "sdpa",
        lora: LoraConfig | None = None,
    ):
        """``reference``: hold a frozen reference (with ``lora`` on: the actor with its adapters off, no copy)."""
        ctx = context()
        self.model_dir = Path(model_dir)
        self.device, self.rank, self.world_size = ctx.device, ctx.rank, ctx.world_size
        torch.manual_seed(seed)
        mesh = build_mesh(self.device.type, ctx.world_size, fsdp)
        load: dict[str, Any] = dict(
            dtype=torch.float32,
            device=self.device,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
        )
        self.lora = lora if lora is not None and lora.enabled else None
        self.lora_binding: LoraBinding | None = None
        """The modules this rank's adapters bound to (with ``lora``)."""
        if self.lora is not None:  # a frozen base needs no fp32 master copy: it stays in the compute dtype
            base = load_causal_lm(self.model_dir, **{**load, "dtype": param_dtype(fsdp, self.device.type)})
            self.lora_binding = apply_lora(base, self.lora)
            self.actor = TrainedModel.build(base, mesh, fsdp, optim, optimizer_steps)
        else:
            self.actor = TrainedModel.build(load_causal_lm(self.model_dir, **load), mesh, fsdp, optim, optimizer_steps)
        self.reference: torch.nn.Module | None = None
        """A frozen copy of the initial policy (full fine-tuning with a KL term)."""
        self.base_is_reference = reference and self.lora is not None
        """The KL reference is the actor with its adapters off."""
        if reference and self.lora is None:
            self.reference = apply_fsdp(load_causal_lm(self.model_dir, **load).requires_grad_(False), mesh, fsdp)
        self.clock = PhaseClock(self.device)
        self.memory = self._memory_tracker(engine=None)
        ctx.set_memory_report("policy", lambda: self.memory.breakdown_mb())  # in an out-of-memory error
        self.grads: diagnostics.GradReport | None = None
        """The last optimizer step's gradient report (per-unit local norms before clipping, global norm, loss)."""

    @contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module | None]:
        """The model that scores the KL reference in the ``with`` block: the frozen copy, the actor with its
        adapters off (LoRA), or None without a reference."""
        if self.base_is_reference:
            with adapters_disabled(self.actor.model):
                yield self.actor.model
        else:
            yield self.reference

    def _memory_tracker(self, engine: torch.nn.Module | None) -> diagnostics.MemoryTracker:
        models = [m for m in (self.actor.model, self.reference) if m is not None]
        return diagnostics.MemoryTracker(self.device, models=models, optimizers=[self.actor.optimizer], engine=engine)

    def setup_report(self) -> dict[str, object]:
        return {"device": str(self.device), "memory_mb": diagnostics.memory_mb(self.device)}

    def close(self) -> None:
        context().set_memory_report("policy", None)

    # -- diagnostics (combined on the controller by rlkit.diagnostics) ---------------------------

    def others(self) -> dict[str, torch.nn.Module]:
        """The models besides the actor that this rank holds, by name, for :meth:`inspect`."""
        return {} if self.reference is None else {"reference": self.reference}

    def inspect(self) -> diagnostics.RankReport:
        """The actor with its optimizer, and :meth:`others`."""
        return diagnostics.inspect(self.actor.model, self.actor.optimizer, others=self.others())

    def adapter_binding(self) -> LoraBinding | None:
        """The modules this rank's LoRA adapters bound to (None without LoRA)."""
        return self.lora_binding

    def memory_marks(self) -> list[diagnostics.MemoryMark]:
        return self.memory.marks

    def grad_report(self) -> diagnostics.GradReport | None:
        return self.grads

    def steps_begun(self) -> int:
        """The actor's optimizer steps begun so far (the controller compares them around an update that failed)."""
        return self.actor.steps_begun

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, directory: str, export_hf_weights: bool) -> None:
        """This rank's shards of actor and optimizer, its schedule and RNG; with ``export_hf_weights`` an HF export."""
        path = Path(directory)
        self.actor.save(path, "actor", self.rank)
        torch.save({"rng": torch.get_rng_state()}, path / f"rng_rank{self.rank}.pt")
        if export_hf_weights:
            if self.rank == 0:
                (path / "hf").mkdir()
            dist.barrier()
            self.export(str(path / "hf"))

    def export(self, directory: str) -> None:
        """The actor's full weights as a Hugging Face directory (rank 0 writes; every rank gathers). With LoRA: the
        adapters merged into the base, and the adapters alone as a peft directory in its ``adapter/`` folder."""
        if self.lora is None:
            export_hf(self.actor.model, Path(directory), self.model_dir)
            return
        merged = {n: t.cpu() for n, t in engine_weights(self.actor.model, self.lora, "merged") if self.rank == 0}
        if self.rank == 0:
            write_hf(merged, self.actor.model, Path(directory), self.model_dir)
        export_adapter(self.actor.model, Path(directory) / "adapter", self.lora, str(self.model_dir))

    def load(self, directory: str) -> None:
        """Restore what :meth:`save` wrote."""
        path = Path(directory)
        self.actor.load(path, "actor", self.rank)
        torch.set_rng_state(torch.load(path / f"rng_rank{self.rank}.pt", weights_only=True)["rng"])
