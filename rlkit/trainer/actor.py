"""The policy being trained, on one rank: the FSDP-wrapped model, its optimizer and schedule."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.config import GRPOConfig
from rlkit.diagnostics import GradReport, MemoryTracker, grad_report
from rlkit.fsdp import apply_fsdp, clip_grad_norm
from rlkit.models.logprobs import response_logprobs
from rlkit.trainer.optim import build_optimizer

STAT_NAMES = ("loss", "clipped", "kl", "tokens", "steps")
"""The sums :meth:`Actor.train_step` returns, in order."""


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GRPOConfig
) -> torch.Tensor:
    """[B, T] response log-probs in micro-batches of ``config.micro_batch_size`` rows. Shapes: [B, P + T] in."""
    micro, width, temperature = config.micro_batch_size, config.rollout.max_new_tokens, config.rollout.temperature
    parts = [
        response_logprobs(model, input_ids[i : i + micro], attention_mask[i : i + micro], width, temperature)
        for i in range(0, input_ids.shape[0], micro)
    ]
    return torch.cat(parts)


class Actor:
    """FSDP-sharded policy with AdamW (built after wrapping) and an LR schedule.

    :meth:`train_step` computes a token-mean loss over the whole mini-batch across
    all ranks, whatever the micro-batch size: each micro-batch's token sum is
    divided by the global token count and multiplied by the world size, since
    FSDP averages gradients over ranks.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, config: GRPOConfig):
        self.config = config
        self.model = apply_fsdp(model, mesh, config.fsdp)
        self.world_size = dist.get_world_size()
        total = config.steps * config.ppo_epochs * config.mini_batches
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.optim, total)
        self.memory: MemoryTracker | None = None
        """Set by the owner to take memory marks after forward/backward and after the optimizer step."""
        self.grads: GradReport | None = None
        """The last optimizer step's gradient report (per-unit local norms before clipping, global norm)."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return batched_logprobs(self.model, input_ids, attention_mask, self.config)

    def train_step(self, mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """One optimizer step on this rank's part of a mini-batch, accumulating micro-batch gradients.

        Args:
            mini: input_ids, attention_mask [n, P + T]; response_mask, logprobs (old), and optionally
                ref_logprobs [n, T]; advantages [n].
        Returns:
            [5] float64 sums on this rank (see STAT_NAMES) and the true global gradient norm.
        """
        cfg = self.config
        tokens = mini["response_mask"].sum().to(torch.float64)
        dist.all_reduce(tokens)
        scale = self.world_size / tokens.clamp(min=1).item()
        sums = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for i in range(0, mini["input_ids"].shape[0], cfg.micro_batch_size):
            micro = {k: v[i : i + cfg.micro_batch_size] for k, v in mini.items()}
            loss_sum, stats = self._micro_loss(micro)
            (loss_sum * scale).backward()
            sums[:4] += stats
        sums[0] *= scale / self.world_size
        sums[4] = 1.0
        self._mark("forward_backward")
        grads = grad_report(self.model)
        norm = clip_grad_norm(self.model, cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self._mark("optimizer_step")
        self.grads = replace(grads, global_norm=norm)
        return sums, norm

    def _mark(self, phase: str) -> None:
        if self.memory is not None:
            self.memory.mark(phase)

    def _micro_loss(self, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed per-token loss of one micro-batch and [4] stat sums (loss, clipped, kl, tokens)."""
        cfg = self.config
        mask = micro["response_mask"]
        logp = response_logprobs(
            self.model, micro["input_ids"], micro["attention_mask"], cfg.rollout.max_new_tokens, cfg.rollout.temperature
        )
        per_token, clipped = clipped_policy_loss(logp, micro["logprobs"], micro["advantages"], cfg.clip_eps)
        kl = torch.zeros_like(per_token)
        if "ref_logprobs" in micro:
            kl = kl_estimate(logp, micro["ref_logprobs"], "k3")
            per_token = per_token + cfg.kl_coef * kl
        loss_sum = (per_token * mask).sum()
        stats = torch.stack([loss_sum, (clipped * mask).sum(), (kl * mask).sum(), mask.sum()]).detach()
        return loss_sum, stats.to(torch.float64)
