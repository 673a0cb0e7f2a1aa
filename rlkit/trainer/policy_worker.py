"""What each rank holds and does: the FSDP actor, the frozen reference, the rollout engine.

The controller (:class:`rlkit.Trainer`) calls the module-level functions below
through ``cluster.run``; they find this rank's :class:`PolicyWorker` in the
worker context. All ranks run the same number of forward passes per phase
(equal shards, equal micro-batches), as FSDP's collectives require.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.config import GRPOConfig
from rlkit.diagnostics import GradReport, MemoryTracker, grad_report
from rlkit.diagnostics.memory import memory_mb
from rlkit.fsdp import apply_fsdp
from rlkit.fsdp.apply import param_dtype
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.logprobs import response_logprobs
from rlkit.rollout import HFEngine, SamplingParams, gathered_weights
from rlkit.runtime import context

log = logging.getLogger(__name__)

STATE_KEY = "rlkit.policy_worker"


class PolicyWorker:
    """One rank's share of the policy: sharded actor + optimizer, sharded reference, whole rollout engine."""

    def __init__(self, config: GRPOConfig, model_dir: Path):
        ctx = context()
        self.config = config
        self.device = ctx.device
        self.world_size = ctx.world_size
        torch.manual_seed(config.seed)
        mesh = init_device_mesh(self.device.type, (ctx.world_size,))
        tokenizer = load_tokenizer(model_dir, trust_remote_code=config.trust_remote_code)
        load = dict(device=self.device, trust_remote_code=config.trust_remote_code)
        self.actor = apply_fsdp(load_causal_lm(model_dir, dtype=torch.float32, **load), mesh, config.fsdp)
        self.optimizer = torch.optim.AdamW(
            self.actor.parameters(),
            lr=config.optim.lr,
            betas=config.optim.betas,
            eps=config.optim.eps,
            weight_decay=config.optim.weight_decay,
        )
        self.reference = None
        if config.kl_coef > 0:
            reference = load_causal_lm(model_dir, dtype=torch.float32, **load).requires_grad_(False)
            self.reference = apply_fsdp(reference, mesh, config.fsdp)
        engine_dtype = param_dtype(config.fsdp, self.device.type)
        self.engine = HFEngine(
            load_causal_lm(model_dir, dtype=engine_dtype, **load),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        self.times: dict[str, float] = {}
        roles = [m for m in (self.actor, self.reference) if m is not None]
        self.memory = MemoryTracker(self.device, models=roles, optimizers=[self.optimizer], engine=self.engine.model)
        self.grads: GradReport | None = None  # the last optimizer step's (before clipping), with the update's loss

    @contextmanager
    def timed(self, phase: str):
        """Record the seconds spent in ``phase`` (synchronising the device so GPU work is counted)."""
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[phase] = time.perf_counter() - start

    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, object]:
        """Generate for this rank's prompts, then score the samples with the actor (and reference).

        Args:
            prompt_ids, prompt_mask: [N, P] left-padded prompts for this rank.
            seed: sampling seed for this rank and step.
        Returns:
            tensors [N*G, T] (response_ids, response_mask, rollout_logprobs, logprobs, ref_logprobs or
            None), finish_reason, and this rank's phase times and memory.
        """
        self.times = {}
        self.memory.reset()
        cfg = self.config
        params = SamplingParams(
            n=cfg.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=seed,
        )
        with self.timed("generate"):
            gen = self.engine.generate(prompt_ids.to(self.device), prompt_mask.to(self.device), params)
        self.memory.mark("rollout")
        prompts = prompt_ids.to(self.device).repeat_interleave(cfg.group_size, dim=0)
        masks = prompt_mask.to(self.device).repeat_interleave(cfg.group_size, dim=0)
        input_ids = torch.cat([prompts, gen.response_ids], dim=1)
        attention_mask = torch.cat([masks, gen.response_mask.long()], dim=1)
        with self.timed("logprobs"):
            logprobs = self.logprobs(self.actor, input_ids, attention_mask)
        self.memory.mark("actor_logprobs")
        ref_logprobs = None
        if self.reference is not None:
            with self.timed("reference"):
                ref_logprobs = self.logprobs(self.reference, input_ids, attention_mask)
            self.memory.mark("reference")
        return {
            "response_ids": gen.response_ids.cpu(),
            "response_mask": gen.response_mask.cpu(),
            "rollout_logprobs": gen.logprobs.cpu(),
            "logprobs": logprobs.cpu(),
            "ref_logprobs": None if ref_logprobs is None else ref_logprobs.cpu(),
            "finish_reason": gen.finish_reason,
            "times": dict(self.times),
            "memory_mb": memory_mb(self.device),
        }

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of the responses, in micro-batches. Shapes: [B, P + T] in."""
        width = self.config.rollout.max_new_tokens
        size = self.config.micro_batch_size
        parts = [
            response_logprobs(model, input_ids[i : i + size], attention_mask[i : i + size], width, self.config.rollout.temperature)
            for i in range(0, input_ids.shape[0], size)
        ]
        return torch.cat(parts)

    def update(self, shard: dict[str, torch.Tensor]) -> dict[str, object]:
        """PPO-clip epochs over this rank's shard, then push the new weights into the engine.

        Args:
            shard: input_ids, attention_mask [n, P + T]; response_mask, logprobs (old), ref_logprobs
                (optional) [n, T]; advantages [n].
        Returns:
            global metrics (identical on every rank), this rank's grad norms and loss, times, memory.
        """
        self.times = {}
        shard = {k: v.to(self.device) for k, v in shard.items() if v is not None}
        cfg = self.config
        n = shard["input_ids"].shape[0]
        size = n // cfg.mini_batches
        totals = torch.zeros(5, dtype=torch.float64, device=self.device)
        grad_norms = []
        with self.timed("update"):
            for _ in range(cfg.ppo_epochs):
                for start in range(0, n, size):
                    mini = {k: v[start : start + size] for k, v in shard.items()}
                    sums, norm = self._optimizer_step(mini)
                    totals += sums
                    grad_norms.append(norm)
        with self.timed("sync"):
            loaded = self.engine.load_weights(gathered_weights(self.actor))
        self.memory.mark("weight_sync")
        dist.all_reduce(totals)
        loss, clipped, kl, tokens, steps = totals.tolist()
        steps = steps / self.world_size
        self.grads = replace(self.grads, loss=loss / steps)
        return {
            "policy/loss": loss / steps,
            "policy/clipfrac": clipped / tokens,
            "kl/mean": kl / tokens,
            "grad/norm": sum(grad_norms) / len(grad_norms),
            "sync/tensors": loaded,
            "times": dict(self.times),
            "memory_mb": memory_mb(self.device),
        }

    def _optimizer_step(self, mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """One optimizer step on a mini-batch, accumulating micro-batch gradients.

        Token-mean over the mini-batch across all ranks: each micro-batch's token
        sum is divided by the global token count and multiplied by the world size,
        since FSDP averages gradients over ranks.

        Returns:
            [5] float64 sums on this rank (loss, clipped tokens, kl, tokens, 1 step), and the global grad norm.
        """
        cfg = self.config
        tokens = mini["response_mask"].sum().to(torch.float64)
        global_tokens = tokens.clone()
        dist.all_reduce(global_tokens)
        scale = self.world_size / global_tokens.clamp(min=1).item()
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        width = cfg.rollout.max_new_tokens
        for i in range(0, mini["input_ids"].shape[0], cfg.micro_batch_size):
            micro = {k: v[i : i + cfg.micro_batch_size] for k, v in mini.items()}
            mask = micro["response_mask"]
            logp = response_logprobs(self.actor, micro["input_ids"], micro["attention_mask"], width, cfg.rollout.temperature)
            per_token, clipped = clipped_policy_loss(logp, micro["logprobs"], micro["advantages"], cfg.clip_eps)
            kl = torch.zeros_like(per_token)
            if "ref_logprobs" in micro:
                kl = kl_estimate(logp, micro["ref_logprobs"], "k3")
                per_token = per_token + cfg.kl_coef * kl
            loss_sum = (per_token * mask).sum()
            (loss_sum * scale).backward()
            sums += torch.stack(
                [
                    loss_sum.detach() / self.world_size * scale,
                    (clipped * mask).sum().detach(),
                    (kl * mask).sum().detach(),
                    mask.sum().detach(),
                    torch.zeros((), device=self.device),
                ]
            ).to(torch.float64)
        sums[4] = 1.0
        self.memory.mark("forward_backward")
        grads = grad_report(self.actor)
        max_norm = cfg.optim.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.memory.mark("optimizer_step")
        self.grads = replace(grads, global_norm=norm.item())
        return sums, norm.item()


def setup(config: dict, model_dir: str) -> dict[str, object]:
    """Build this rank's PolicyWorker (replacing any earlier one); returns what it holds."""
    ctx = context()
    ctx.state.pop(STATE_KEY, None)
    worker = PolicyWorker(GRPOConfig.from_dict(config), Path(model_dir))
    ctx.state[STATE_KEY] = worker
    log.info("policy worker ready on %s", ctx.device)
    return {"device": str(ctx.device), "memory_mb": memory_mb(ctx.device)}


def rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, object]:
    worker: PolicyWorker = context().state[STATE_KEY]
    return worker.rollout(prompt_ids, prompt_mask, seed)


def update(shard: dict[str, torch.Tensor]) -> dict[str, object]:
    worker: PolicyWorker = context().state[STATE_KEY]
    return worker.update(shard)
