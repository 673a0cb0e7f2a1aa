"""Runs on every rank: PPO's critic role, an FSDP-sharded value model with its own optimizer and schedule.

The controller calls it through :class:`rlkit.runtime.RoleGroup`, apart from the policy, so
either role can change without the other.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from rlkit import diagnostics
from rlkit.algos import Mean, loss_weights, value_objective
from rlkit.config import PPOConfig
from rlkit.fsdp import build_mesh, param_dtype
from rlkit.models.lora import apply_lora
from rlkit.models.packing import can_pack
from rlkit.models.value import load_value_model, response_values, value_head_name
from rlkit.runtime import Role, context
from rlkit.workers.batches import CriticRows, global_counts, in_micro_batches, micro_batches, mini_batches
from rlkit.workers.messages import UpdateResult, ValuesResult
from rlkit.workers.metrics import MetricSums
from rlkit.workers.phases import PhaseClock
from rlkit.workers.training import TrainedModel


class CriticWorker(Role):
    """Value model V(s_t) for every response token, trained on the returns with the clipped value loss."""

    def __init__(self, config: PPOConfig, model_dir: str | Path):
        ctx = context()
        self.config = config
        self.rank, self.world_size = ctx.rank, ctx.world_size
        torch.manual_seed(config.seed)  # the new value head must be the same on every rank
        lora = config.critic.lora if config.critic.lora.enabled else None
        model = load_value_model(
            Path(model_dir),
            dtype=torch.float32 if lora is None else param_dtype(config.fsdp, ctx.device.type),  # a frozen base
            device=ctx.device,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation,
        )
        self.lora_binding = None if lora is None else apply_lora(model, lora, head=value_head_name(model))
        """The modules the backbone's adapters bound to (``critic.lora``; the value head trains whole)."""
        self.padding_free = config.padding_free and can_pack(model)
        mesh = build_mesh(ctx.device.type, ctx.world_size, config.fsdp)
        optimizer_steps = config.steps * config.ppo_epochs * config.mini_batches
        self.critic = TrainedModel.build(model, mesh, config.fsdp, config.critic.optim, optimizer_steps)
        self.clock = PhaseClock(ctx.device)

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ValuesResult:
        """[n, T] values of this rank's sequences ([n, P + T] in), in the update's micro-batches."""
        self.clock.start()
        cfg, device = self.config, self.critic.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        with self.clock.timed("critic_values"):
            values = in_micro_batches(
                self._values, input_ids, attention_mask, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch
            )
            values = values * attention_mask[:, -cfg.rollout.max_new_tokens :]
        return ValuesResult(values=values.cpu(), times=dict(self.clock.times), memory_mb=diagnostics.memory_mb(device))

    def update(self, rows: CriticRows) -> UpdateResult:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps of the clipped value loss on this rank's rows."""
        cfg, critic, horizon = self.config, self.critic, self.config.rollout.max_new_tokens
        self.clock.start()
        rows = rows.to(critic.device)
        sums = MetricSums(critic.device)
        skipped = 0  # optimizer steps skipped on a non-finite gradient norm (every rank alike)
        with self.clock.timed("critic_update"):
            for _ in range(cfg.ppo_epochs):
                for mini in mini_batches(rows, cfg.mini_batches):
                    num_tokens, num_seqs = global_counts(mini.response_mask)
                    critic.optimizer.zero_grad(set_to_none=True)
                    step_loss = torch.zeros((), device=critic.device)
                    for _, micro in micro_batches(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch):
                        weights = loss_weights(
                            micro.response_mask, cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
                        )
                        values = self._values(micro.input_ids, micro.attention_mask)
                        loss, micro_metrics = value_objective(
                            values, micro.old_values, micro.returns, micro.response_mask, weights,
                            clip=cfg.critic.value_clip or None,
                        )  # fmt: skip
                        loss.backward()
                        sums.add(micro_metrics)
                        step_loss += loss.detach()
                    norm = critic.clip_and_step(cfg.critic.optim.max_grad_norm)
                    skipped += not math.isfinite(norm)
                    sums.add({"critic/loss": Mean(step_loss, 1 / self.world_size), "critic/grad_norm": Mean(norm, 1)})
        metrics = {**sums.reduce(), "critic/lr": critic.lr, "critic/skipped_steps": float(skipped)}
        return UpdateResult(
            metrics=metrics, times=dict(self.clock.times), memory_mb=diagnostics.memory_mb(critic.device)
        )

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            # the head is a Linear with bias, whose output on [B, L, H] is a view; FSDP2 warns against
            # in-place ops on it, and none are done here
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            return response_values(
                self.critic.model,
                input_ids,
                attention_mask,
                response_width=self.config.rollout.max_new_tokens,
                padding_free=self.padding_free,
            )

    def steps_begun(self) -> int:
        """The critic's optimizer steps begun so far (the controller compares them around an update that failed)."""
        return self.critic.steps_begun

    def save(self, directory: str) -> None:
        """This rank's shards of the critic and its optimizer, and its schedule."""
        self.critic.save(Path(directory), "critic", self.rank)

    def load(self, directory: str) -> None:
        self.critic.load(Path(directory), "critic", self.rank)
