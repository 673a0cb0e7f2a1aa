"""The policy being trained, on one rank: the FSDP-wrapped model, its optimizer and schedule."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlkit.config import RLConfig
from rlkit.diagnostics import GradReport, MemoryTracker, grad_report
from rlkit.fsdp import apply_fsdp
from rlkit.models.head import install_response_head
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import can_pack
from rlkit.trainer.accumulate import accumulated_step
from rlkit.trainer.objective import STAT_NAMES, PolicyLossFn, PolicyObjective
from rlkit.trainer.optim import build_optimizer

__all__ = ["STAT_NAMES", "Actor", "batched_logprobs"]


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: RLConfig
) -> torch.Tensor:
    """[B, T] response log-probs in micro-batches of ``config.micro_batch_size`` rows. Shapes: [B, P + T] in."""
    micro, width, temperature = config.micro_batch_size, config.rollout.max_new_tokens, config.rollout.temperature
    padding_free = config.padding_free and can_pack(model)
    parts = [
        response_logprobs(
            model,
            input_ids[i : i + micro],
            attention_mask[i : i + micro],
            response_width=width,
            temperature=temperature,
            padding_free=padding_free,
        )[0]
        for i in range(0, input_ids.shape[0], micro)
    ]
    return torch.cat(parts)


class Actor:
    """FSDP-sharded policy with AdamW (built after wrapping), an LR schedule and its objective.

    :meth:`train_step` computes the loss of the whole mini-batch across all ranks in
    the config's aggregation mode, whatever the micro-batch size (see
    :mod:`rlkit.trainer.accumulate`).
    """

    def __init__(
        self, model: torch.nn.Module, mesh: DeviceMesh, config: RLConfig, policy_loss_fn: PolicyLossFn | None = None
    ):
        self.config = config
        install_response_head(model)
        self.padding_free = config.padding_free and can_pack(model)
        self.model = apply_fsdp(model, mesh, config.fsdp)
        self.world_size = dist.get_world_size()
        total = config.steps * config.ppo_epochs * config.mini_batches
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.optim, total)
        self.objective = PolicyObjective(config, policy_loss_fn)
        self.memory: MemoryTracker | None = None
        """Set by the owner to take memory marks after forward/backward and after the optimizer step."""
        self.grads: GradReport | None = None
        """The last optimizer step's gradient report (per-unit local norms before clipping, global norm)."""
        self._unclipped: GradReport | None = None
        self._scored: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return batched_logprobs(self.model, input_ids, attention_mask, self.config)

    def train_step(self, mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """One optimizer step on this rank's part of a mini-batch, accumulating micro-batch gradients.

        Args:
            mini: input_ids, attention_mask [n, P + T]; response_mask, optionally logprobs (old) and
                ref_logprobs [n, T]; advantages [n] or [n, T]. Without old log-probs (one optimizer
                step per batch, ``recompute_logprobs=False``) this step's own are the old ones: see
                :meth:`scored_logprobs`.
        Returns:
            [7] float64 sums on this rank (see STAT_NAMES) and the true global gradient norm.
        """
        cfg = self.config
        self._scored = []
        sums, norm = accumulated_step(
            self.model,
            self.optimizer,
            self.scheduler,
            mini,
            micro_loss=self._micro_loss,
            num_stats=len(STAT_NAMES) - 1,
            micro_batch_size=cfg.micro_batch_size,
            loss_agg=cfg.loss_agg,
            horizon=cfg.rollout.max_new_tokens,
            max_grad_norm=cfg.optim.max_grad_norm,
            before_clip=self._before_clip,
        )
        self._mark("optimizer_step")
        self.grads = replace(self._unclipped, global_norm=norm)
        return sums, norm

    def _before_clip(self) -> None:
        """After forward/backward: a memory mark and the per-unit gradient norms before clipping."""
        self._mark("forward_backward")
        self._unclipped = grad_report(self.model)

    def _mark(self, phase: str) -> None:
        if self.memory is not None:
            self.memory.mark(phase)

    def scored_logprobs(self) -> torch.Tensor:
        """[n, T] detached log-probs of the last :meth:`train_step`'s rows, taken from its forward passes."""
        return torch.cat(self._scored)

    def _micro_loss(self, micro: dict[str, torch.Tensor], weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the loss (weights: [b, T]) and its stat sums."""
        cfg = self.config
        width, temperature = cfg.rollout.max_new_tokens, cfg.rollout.temperature
        logprobs, entropy = response_logprobs(
            self.model,
            micro["input_ids"],
            micro["attention_mask"],
            response_width=width,
            temperature=temperature,
            padding_free=self.padding_free,
            entropy="grad" if cfg.entropy_coef > 0 else "detached",  # the bonus needs the entropy's gradient
        )
        if "logprobs" not in micro:
            self._scored.append(logprobs.detach())
            micro = {**micro, "logprobs": logprobs.detach()}
        return self.objective(logprobs, entropy, micro, weights)
