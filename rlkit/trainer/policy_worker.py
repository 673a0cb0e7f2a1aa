"""What each rank holds and does: the FSDP actor, the frozen reference, the rollout engine.

The controller (:class:`rlkit.Trainer`) calls the module-level functions below
through ``cluster.run``; they find this rank's :class:`PolicyWorker` in the
worker context. All ranks run the same number of forward passes per phase
(equal shards, equal micro-batches), as FSDP's collectives require.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.config import RLConfig, config_from_dict
from rlkit.diagnostics import MemoryTracker
from rlkit.diagnostics.memory import memory_mb
from rlkit.fsdp import apply_fsdp, build_mesh, iter_full_params, param_dtype
from rlkit.fsdp.checkpoint import export_hf, load_sharded, save_sharded
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.rollout import SamplingParams, build_engine
from rlkit.runtime import context
from rlkit.trainer.actor import STAT_NAMES, Actor, batched_logprobs
from rlkit.trainer.objective import PolicyLossFn, policy_metrics

log = logging.getLogger(__name__)

STATE_KEY = "rlkit.policy_worker"


class PolicyWorker:
    """One rank's share of the policy: sharded actor + optimizer, sharded reference, whole rollout engine."""

    def __init__(self, config: RLConfig, model_dir: Path, policy_loss_fn: PolicyLossFn | None = None):
        ctx = context()
        self.config = config
        self.model_dir = model_dir
        self.device = ctx.device
        self.rank = ctx.rank
        torch.manual_seed(config.seed)
        mesh = build_mesh(self.device.type, ctx.world_size, config.fsdp)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=config.trust_remote_code)
        load = dict(
            device=self.device,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation,
        )
        self.actor = Actor(load_causal_lm(model_dir, dtype=torch.float32, **load), mesh, config, policy_loss_fn)
        self.reference = None
        if config.kl_coef > 0:
            reference = load_causal_lm(model_dir, dtype=torch.float32, **load).requires_grad_(False)
            self.reference = apply_fsdp(reference, mesh, config.fsdp)
        self.engine = build_engine(
            config.rollout,
            model_dir,
            device=self.device,
            dtype=param_dtype(config.fsdp, self.device.type),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_num_seqs=config.samples_per_step // ctx.world_size,
            seed=config.seed,
            trust_remote_code=config.trust_remote_code,
        )
        self.times: dict[str, float] = {}
        models = [m for m in (self.actor.model, self.reference) if m is not None]
        self.memory = MemoryTracker(self.device, models=models, optimizers=[self.actor.optimizer], engine=getattr(self.engine, "model", None))
        self.actor.memory = self.memory

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
            tensors [N*G, T] (response_ids, response_mask, rollout_logprobs, and logprobs and ref_logprobs
            or None), finish_reason, and this rank's phase times and memory.
        """
        self.times = {}
        self.memory.reset()
        cfg = self.config
        params = SamplingParams(
            n=cfg.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            min_new_tokens=cfg.rollout.min_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=seed,
        )
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        with self.timed("generate"):
            gen = self.engine.generate(prompt_ids, prompt_mask, params)
        self.memory.mark("rollout")
        with self.timed("engine_sleep"):
            self.engine.sleep()  # hybrid engine: free its memory for the actor until the next sync
        input_ids = torch.cat([prompt_ids.repeat_interleave(cfg.group_size, dim=0), gen.response_ids], dim=1)
        attention_mask = torch.cat(
            [prompt_mask.repeat_interleave(cfg.group_size, dim=0), gen.response_mask.long()], dim=1
        )
        logprobs = None
        if cfg.recompute_logprobs:
            with self.timed("logprobs"):
                logprobs = self.actor.logprobs(input_ids, attention_mask)
            self.memory.mark("actor_logprobs")
        ref_logprobs = None
        if self.reference is not None:
            with self.timed("reference"):
                ref_logprobs = batched_logprobs(self.reference, input_ids, attention_mask, cfg)
            self.memory.mark("reference")
        return {
            "response_ids": gen.response_ids.cpu(),
            "response_mask": gen.response_mask.cpu(),
            "rollout_logprobs": gen.logprobs.cpu(),
            "logprobs": None if logprobs is None else logprobs.cpu(),
            "ref_logprobs": None if ref_logprobs is None else ref_logprobs.cpu(),
            "finish_reason": gen.finish_reason,
            "times": dict(self.times),
            "memory_mb": memory_mb(self.device),
        }

    def update(self, shard: dict[str, torch.Tensor]) -> dict[str, object]:
        """PPO-clip epochs over this rank's shard, then push the new weights into the engine.

        Args:
            shard: input_ids, attention_mask [n, P + T]; response_mask, logprobs (old; None without
                ``recompute_logprobs``), ref_logprobs (optional), advantages [n, T].
        Returns:
            global metrics (identical on every rank), this rank's grad norm, times, memory, and
            ``logprobs`` [n, T]: the shard's old log-probs when the update computed them, else None.
        """
        self.times = {}
        shard = {k: v.to(self.device) for k, v in shard.items() if v is not None}
        cfg = self.config
        n = shard["input_ids"].shape[0]
        size = n // cfg.mini_batches
        totals = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=self.device)
        grad_norms = []
        with self.timed("update"):
            for _ in range(cfg.ppo_epochs):
                for start in range(0, n, size):
                    sums, norm = self.actor.train_step({k: v[start : start + size] for k, v in shard.items()})
                    totals += sums
                    grad_norms.append(norm)
        scored = None if "logprobs" in shard else self.actor.scored_logprobs().cpu()
        self.sync_engine()
        self.memory.mark("weight_sync")
        dist.all_reduce(totals)
        metrics = policy_metrics(totals, dist.get_world_size())
        self.actor.grads = replace(self.actor.grads, loss=metrics["policy/loss"])
        return {
            **metrics,
            "grad/norm": sum(grad_norms) / len(grad_norms),
            "optim/lr": self.actor.scheduler.get_last_lr()[0],
            "logprobs": scored,
            "times": dict(self.times),
            "memory_mb": memory_mb(self.device),
        }

    def sync_engine(self) -> int:
        """Push the actor's full weights into the rollout engine; returns how many tensors were loaded."""
        with self.timed("sync"):
            return self.engine.load_weights(iter_full_params(self.actor.model))

    def close(self) -> None:
        """Stop the rollout engine (and any processes it owns)."""
        self.engine.close()

    def save(self, directory: Path, *, export: bool) -> None:
        """Write this rank's shards (model + optimizer) and schedule/RNG state; rank 0 also exports HF files."""
        save_sharded(self.actor.model, self.actor.optimizer, directory / "shards")
        torch.save(
            {"scheduler": self.actor.scheduler.state_dict(), "rng": torch.get_rng_state()},
            directory / f"rank{self.rank}.pt",
        )
        if export:
            if self.rank == 0:
                (directory / "hf").mkdir()
            dist.barrier()
            export_hf(self.actor.model, directory / "hf", self.model_dir)

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote, then sync the engine to the restored weights."""
        load_sharded(self.actor.model, self.actor.optimizer, directory / "shards")
        extra = torch.load(directory / f"rank{self.rank}.pt", weights_only=True)
        self.actor.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        self.sync_engine()


def setup(config: dict, model_dir: str, policy_loss_fn: PolicyLossFn | None = None) -> dict[str, object]:
    """Build this rank's PolicyWorker (replacing any earlier one); returns what it holds."""
    ctx = context()
    previous = ctx.state.pop(STATE_KEY, None)
    if previous is not None:
        previous.close()
    worker = PolicyWorker(config_from_dict(config), Path(model_dir), policy_loss_fn)
    ctx.state[STATE_KEY] = worker
    log.info("policy worker ready on %s", ctx.device)
    return {"device": str(ctx.device), "memory_mb": memory_mb(ctx.device)}


def _worker() -> PolicyWorker:
    return context().state[STATE_KEY]


def rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, object]:
    return _worker().rollout(prompt_ids, prompt_mask, seed)


def update(shard: dict[str, torch.Tensor]) -> dict[str, object]:
    return _worker().update(shard)


def save(directory: str, export: bool) -> None:
    _worker().save(Path(directory), export=export)


def load(directory: str) -> None:
    _worker().load(Path(directory))
