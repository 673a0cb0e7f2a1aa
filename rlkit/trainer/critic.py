"""PPO's critic on one rank: an FSDP-sharded value model with its own optimizer and schedule.

The controller calls the module-level functions through ``cluster.run``; they find
this rank's :class:`Critic` in the worker context (apart from the policy worker, so
either role can change without the other).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.algos import clipped_value_loss
from rlkit.config import PPOConfig, config_from_dict
from rlkit.diagnostics.memory import memory_mb
from rlkit.fsdp import apply_fsdp, build_mesh
from rlkit.fsdp.checkpoint import load_sharded, save_sharded
from rlkit.models import resolve_model_dir
from rlkit.models.packing import can_pack
from rlkit.models.value import load_value_model, response_values
from rlkit.runtime import context
from rlkit.trainer.accumulate import accumulated_step
from rlkit.trainer.optim import build_optimizer

log = logging.getLogger(__name__)

STATE_KEY = "rlkit.critic"
CRITIC_STATS = ("loss", "clipped", "tokens", "steps")
"""The float64 sums :meth:`Critic.train_step` returns, in order."""


class Critic:
    """Value model V(s_t) for every response token, trained on GAE returns with the clipped value loss."""

    def __init__(self, config: PPOConfig, model_dir: Path):
        ctx = context()
        self.config = config
        self.rank = ctx.rank
        torch.manual_seed(config.seed)  # the new value head must be the same on every rank
        model = load_value_model(
            model_dir,
            dtype=torch.float32,
            device=ctx.device,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation,
        )
        self.padding_free = config.padding_free and can_pack(model)
        self.model = apply_fsdp(model, build_mesh(ctx.device.type, ctx.world_size, config.fsdp), config.fsdp)
        total = config.steps * config.ppo_epochs * config.mini_batches
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.critic.optim, total)

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[n, T] values of this rank's sequences ([n, P + T] in), in micro-batches."""
        cfg, micro = self.config, self.config.micro_batch_size
        device = next(self.model.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        parts = [
            response_values(
                self.model,
                input_ids[i : i + micro],
                attention_mask[i : i + micro],
                response_width=cfg.rollout.max_new_tokens,
                padding_free=self.padding_free,
            )
            for i in range(0, input_ids.shape[0], micro)
        ]
        return torch.cat(parts)

    def train_step(self, mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """One optimizer step on this rank's rows of a mini-batch.

        Args:
            mini: input_ids, attention_mask [n, P + T]; response_mask, values (rollout-time), returns [n, T].
        Returns:
            [4] float64 sums (CRITIC_STATS) and the global gradient norm.
        """
        cfg = self.config
        return accumulated_step(
            self.model,
            self.optimizer,
            self.scheduler,
            mini,
            micro_loss=self._micro_loss,
            num_stats=len(CRITIC_STATS) - 1,
            micro_batch_size=cfg.micro_batch_size,
            loss_agg=cfg.loss_agg,
            horizon=cfg.rollout.max_new_tokens,
            max_grad_norm=cfg.critic.optim.max_grad_norm,
        )

    def _micro_loss(self, micro: dict[str, torch.Tensor], weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        with warnings.catch_warnings():
            # the head is a Linear with bias, whose output on [B, L, H] is a view; FSDP2 warns against
            # in-place ops on it, and none are done here
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            values = response_values(
                self.model,
                micro["input_ids"],
                micro["attention_mask"],
                response_width=cfg.rollout.max_new_tokens,
                padding_free=self.padding_free,
            )
        per_token, clipped = clipped_value_loss(
            values, micro["values"], micro["returns"], cfg.critic.value_clip or None
        )
        mask = micro["response_mask"]
        loss = (per_token * weights).sum()
        return loss, torch.stack([loss.detach(), (clipped * mask).sum(), mask.sum()]).to(torch.float64)

    def update(self, shard: dict[str, torch.Tensor]) -> dict[str, object]:
        """``ppo_epochs`` passes of ``mini_batches`` steps over this rank's shard; returns global metrics."""
        cfg = self.config
        device = next(self.model.parameters()).device
        shard = {k: v.to(device) for k, v in shard.items()}
        n = shard["input_ids"].shape[0]
        size = n // cfg.mini_batches
        totals = torch.zeros(len(CRITIC_STATS), dtype=torch.float64, device=device)
        norms = []
        for _ in range(cfg.ppo_epochs):
            for start in range(0, n, size):
                sums, norm = self.train_step({k: v[start : start + size] for k, v in shard.items()})
                totals += sums
                norms.append(norm)
        dist.all_reduce(totals)
        s = dict(zip(CRITIC_STATS, totals.tolist(), strict=True))
        return {
            "critic/loss": s["loss"] / (s["steps"] / dist.get_world_size()),
            "critic/value_clipfrac": s["clipped"] / max(s["tokens"], 1.0),
            "critic/grad_norm": sum(norms) / len(norms),
            "critic/lr": self.scheduler.get_last_lr()[0],
        }

    def save(self, directory: Path) -> None:
        """This rank's shards of the critic and its optimizer, and its schedule."""
        save_sharded(self.model, self.optimizer, directory / "critic")
        torch.save({"scheduler": self.scheduler.state_dict()}, directory / f"critic_rank{self.rank}.pt")

    def load(self, directory: Path) -> None:
        load_sharded(self.model, self.optimizer, directory / "critic")
        extra = torch.load(directory / f"critic_rank{self.rank}.pt", weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])


def setup(config: dict, model_dir: str) -> dict[str, object]:
    """Build this rank's Critic from the critic's model (or the policy's, ``model_dir``), replacing any earlier one."""
    ctx = context()
    ctx.state.pop(STATE_KEY, None)
    cfg = config_from_dict(config)
    source = resolve_model_dir(cfg.critic.model) if cfg.critic.model else Path(model_dir)
    ctx.state[STATE_KEY] = Critic(cfg, source)
    log.info("critic ready on %s from %s", ctx.device, source)
    return {"memory_mb": memory_mb(ctx.device)}


def _critic() -> Critic:
    return context().state[STATE_KEY]


def values(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, object]:
    """This rank's [n, T] values, with the time spent and memory."""
    start = time.perf_counter()
    out = _critic().values(input_ids, attention_mask).cpu()
    return {"values": out, "times": {"critic_values": time.perf_counter() - start}, "memory_mb": memory_mb(context().device)}


def update(shard: dict[str, torch.Tensor]) -> dict[str, object]:
    """Critic epochs over this rank's shard; global metrics, time spent, memory."""
    start = time.perf_counter()
    stats = _critic().update(shard)
    return {**stats, "times": {"critic_update": time.perf_counter() - start}, "memory_mb": memory_mb(context().device)}


def save(directory: str) -> None:
    _critic().save(Path(directory))


def load(directory: str) -> None:
    _critic().load(Path(directory))
