"""Runs on every rank: the policy role, holding the FSDP actor, the frozen reference and the rollout engine.

The controller (:class:`rlkit.Trainer`) calls its methods through
:class:`rlkit.runtime.RoleGroup`, e.g. ``policy.call(PolicyWorker.update, PerRank(rows))``.
All ranks run the same number of forward passes per phase (equal shards, equal micro-batches),
as FSDP's collectives require.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit import diagnostics
from rlkit.algos import Mean, PolicyLossFn, PolicyObjective, loss_weights, policy_objective
from rlkit.config import RLConfig
from rlkit.fsdp import apply_fsdp, build_mesh, clip_grad_norm, iter_full_params, param_dtype
from rlkit.fsdp.checkpoint import export_hf
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import can_pack
from rlkit.rollout import SamplingParams, build_engine
from rlkit.runtime import Role, context
from rlkit.workers.batches import PolicyRows, global_counts, micro_batches, mini_batches
from rlkit.workers.messages import RolloutResult, UpdateResult
from rlkit.workers.metrics import MetricSums
from rlkit.workers.phases import PhaseClock
from rlkit.workers.training import TrainedModel

logger = logging.getLogger(__name__)


class PolicyWorker(Role):
    """One rank's share of the policy: sharded actor + optimizer, sharded reference, whole rollout engine."""

    def __init__(self, config: RLConfig, model_dir: str | Path, policy_loss_fn: PolicyLossFn | None = None):
        ctx = context()
        self.config = config
        self.model_dir = Path(model_dir)
        self.device, self.rank, self.world_size = ctx.device, ctx.rank, ctx.world_size
        torch.manual_seed(config.seed)
        mesh = build_mesh(self.device.type, ctx.world_size, config.fsdp)
        tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        load = dict(
            dtype=torch.float32,
            device=self.device,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation,
        )
        optimizer_steps = config.steps * config.ppo_epochs * config.mini_batches
        self.actor = TrainedModel.build(
            load_causal_lm(self.model_dir, **load), mesh, config.fsdp, config.optim, optimizer_steps
        )
        self.reference = None
        if config.kl_coef > 0:
            reference = load_causal_lm(self.model_dir, **load).requires_grad_(False)
            self.reference = apply_fsdp(reference, mesh, config.fsdp)
        self.engine = build_engine(
            config.rollout,
            self.model_dir,
            device=self.device,
            dtype=param_dtype(config.fsdp, self.device.type),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_num_seqs=config.samples_per_step // ctx.world_size,
            seed=config.seed,
            trust_remote_code=config.trust_remote_code,
        )
        self.objective = PolicyObjective(
            policy_loss=config.policy_loss,
            clip_eps=config.clip_eps,
            clip_high=config.clip_high,
            dual_clip=config.dual_clip,
            log_ratio_clamp=config.log_ratio_clamp,
            kl_coef=config.kl_coef if config.kl_mode == "loss" else 0.0,
            kl_estimator=config.kl_estimator,
            kl_clamp=config.kl_clamp,
            entropy_coef=config.entropy_coef,
            policy_loss_fn=policy_loss_fn,
        )
        self.clock = PhaseClock(self.device)
        models = [m for m in (self.actor.model, self.reference) if m is not None]
        engine_model = getattr(self.engine, "model", None)
        self.memory = diagnostics.MemoryTracker(
            self.device, models=models, optimizers=[self.actor.optimizer], engine=engine_model
        )
        self.grads: diagnostics.GradReport | None = None
        """The last optimizer step's gradient report (per-unit local norms before clipping, global norm, loss)."""

    def setup_report(self) -> dict[str, object]:
        return {"device": str(self.device), "memory_mb": diagnostics.memory_mb(self.device)}

    # -- the phases of a step ------------------------------------------------------------------

    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> RolloutResult:
        """Generate ``group_size`` completions of this rank's prompts, then score them with the actor and reference.

        Args:
            prompt_ids, prompt_mask: [N, P] left-padded prompts of this rank.
            seed: the sampling seed of this rank and step.
        """
        cfg = self.config
        self.clock.start()
        self.memory.reset()
        params = SamplingParams(
            n=cfg.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            min_new_tokens=cfg.rollout.min_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=seed,
        )
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        with self.clock.timed("generate"):
            gen = self.engine.generate(prompt_ids, prompt_mask, params)
        self.memory.mark("rollout")
        with self.clock.timed("engine_sleep"):
            self.engine.sleep()  # hybrid engine: free its memory for the actor until the next sync
        input_ids = torch.cat([prompt_ids.repeat_interleave(cfg.group_size, dim=0), gen.response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.repeat_interleave(cfg.group_size, dim=0), gen.response_mask.long()], 1)
        old_logprobs = ref_logprobs = None
        if cfg.recompute_logprobs:
            with self.clock.timed("logprobs"):
                old_logprobs = self._scored_logprobs(self.actor.model, input_ids, attention_mask)
            self.memory.mark("actor_logprobs")
        if self.reference is not None:
            with self.clock.timed("reference"):
                ref_logprobs = self._scored_logprobs(self.reference, input_ids, attention_mask)
            self.memory.mark("reference")
        return RolloutResult(
            response_ids=gen.response_ids.cpu(),
            response_mask=gen.response_mask.cpu(),
            rollout_logprobs=gen.logprobs.cpu(),
            rollout_logprob_rows=gen.logprob_rows.cpu(),
            old_logprobs=None if old_logprobs is None else old_logprobs.cpu(),
            ref_logprobs=None if ref_logprobs is None else ref_logprobs.cpu(),
            finish_reason=gen.finish_reason,
            times=dict(self.clock.times),
            memory_mb=diagnostics.memory_mb(self.device),
        )

    def update(self, rows: PolicyRows) -> UpdateResult:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps on this rank's rows, then the weight sync into the engine.

        Each mini-batch's loss is the loss of the whole mini-batch over all ranks in the config's
        aggregation mode, whatever the micro-batch size: the token and sequence counts that
        normalise it are summed over ranks first, and FSDP sums (not averages) gradients over ranks.
        """
        cfg, actor, horizon = self.config, self.actor, self.config.rollout.max_new_tokens
        self.clock.start()
        rows = rows.to(self.device)
        sums = MetricSums(self.device)
        # one optimizer step per batch and no old log-probs from the rollout: the first forward is the old policy
        scored = torch.zeros_like(rows.response_mask) if rows.old_logprobs is None else None
        with self.clock.timed("update"):
            for _ in range(cfg.ppo_epochs):
                for mini in mini_batches(rows, cfg.mini_batches):
                    # 1. the loss normalisers: the whole mini-batch's token and sequence counts over all ranks
                    num_tokens, num_seqs = global_counts(mini.response_mask)
                    actor.optimizer.zero_grad(set_to_none=True)
                    step_loss = torch.zeros((), device=self.device)
                    for index, micro in micro_batches(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch):
                        # 2. the current policy's log-probs of the sampled tokens (and the entropy)
                        new_logprobs, entropy = self._new_logprobs(micro)
                        old_logprobs = micro.old_logprobs
                        if scored is not None:  # the only mini-batch is all the rows: index places them
                            old_logprobs = scored[index.to(self.device)] = new_logprobs.detach()
                        # 3. the objective (pure math in rlkit.algos)
                        weights = loss_weights(
                            micro.response_mask, cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
                        )
                        loss, micro_metrics = policy_objective(
                            new_logprobs, old_logprobs, micro.advantages, micro.response_mask, weights, self.objective,
                            ref_logprobs=micro.ref_logprobs, entropy=entropy,
                        )  # fmt: skip
                        # 4. backward: FSDP sums this rank's gradients with the other ranks'
                        loss.backward()
                        sums.add(micro_metrics)
                        step_loss += loss.detach()
                    # 5. the gradient report, the clip by the true global norm, the optimizer step
                    self.memory.mark("forward_backward")
                    report = diagnostics.grad_report(actor.model)
                    norm = clip_grad_norm(actor.model, cfg.optim.max_grad_norm)
                    actor.optimizer.step()
                    actor.scheduler.step()
                    self.memory.mark("optimizer_step")
                    # this rank's part of the step's loss; the norm is the same on every rank
                    sums.add({"actor/loss": Mean(step_loss, 1 / self.world_size), "actor/grad_norm": Mean(norm, 1)})
        # 6. the new weights into the rollout engine
        self.sync_engine()
        self.memory.mark("weight_sync")
        metrics = {**sums.reduce(), "actor/lr": actor.lr}
        self.grads = dataclasses.replace(report, global_norm=float(norm), loss=metrics["actor/loss"])
        old = None if scored is None else scored.cpu()
        report_memory = diagnostics.memory_mb(self.device)
        return UpdateResult(metrics=metrics, old_logprobs=old, times=dict(self.clock.times), memory_mb=report_memory)

    def sync_engine(self) -> int:
        """Push the actor's full weights into the rollout engine; returns how many tensors were loaded."""
        with self.clock.timed("sync"):
            return self.engine.load_weights(iter_full_params(self.actor.model))

    # -- log-probs -----------------------------------------------------------------------------

    def _new_logprobs(self, micro: PolicyRows) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, T] log-probs of the sampled tokens under the actor (with grad) and the sampling entropy
        (with grad only when the loss has an entropy bonus)."""
        cfg = self.config
        logprobs, entropy = response_logprobs(
            self.actor.model,
            micro.input_ids,
            micro.attention_mask,
            response_width=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            padding_free=cfg.padding_free and can_pack(self.actor.model),
            entropy="grad" if cfg.entropy_coef > 0 else "detached",  # the bonus needs the entropy's gradient
        )
        assert entropy is not None
        return logprobs, entropy

    @torch.no_grad()
    def _scored_logprobs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """[B, T] response log-probs under ``model`` in micro-batches of ``micro_batch_size`` rows, no grad."""
        cfg = self.config
        micro = cfg.micro_batch_size
        parts = [
            response_logprobs(
                model,
                input_ids[i : i + micro],
                attention_mask[i : i + micro],
                response_width=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                padding_free=cfg.padding_free and can_pack(model),
            )[0]
            for i in range(0, input_ids.shape[0], micro)
        ]
        return torch.cat(parts)

    # -- diagnostics (combined on the controller by rlkit.diagnostics) ---------------------------

    def inspect(self) -> diagnostics.RankReport:
        """The actor with its optimizer; the reference and the rollout engine's own model as the others."""
        others: dict[str, torch.nn.Module] = {} if self.reference is None else {"reference": self.reference}
        engine = getattr(self.engine, "model", None)
        if isinstance(engine, torch.nn.Module):
            others["engine"] = engine
        return diagnostics.inspect(self.actor.model, self.actor.optimizer, others=others)

    def memory_marks(self) -> list[diagnostics.MemoryMark]:
        return self.memory.marks

    def grad_report(self) -> diagnostics.GradReport | None:
        return self.grads

    # -- checkpoints and lifetime --------------------------------------------------------------

    def save(self, directory: str, export_hf_weights: bool) -> None:
        """This rank's shards of actor and optimizer, its schedule and RNG; with ``export_hf_weights`` an HF export."""
        path = Path(directory)
        self.actor.save(path, "actor", self.rank)
        torch.save({"rng": torch.get_rng_state()}, path / f"rng_rank{self.rank}.pt")
        if export_hf_weights:
            if self.rank == 0:
                (path / "hf").mkdir()
            dist.barrier()
            export_hf(self.actor.model, path / "hf", self.model_dir)

    def load(self, directory: str) -> None:
        """Restore what :meth:`save` wrote, then sync the engine to the restored weights."""
        path = Path(directory)
        self.actor.load(path, "actor", self.rank)
        torch.set_rng_state(torch.load(path / f"rng_rank{self.rank}.pt", weights_only=True)["rng"])
        self.sync_engine()

    def close(self) -> None:
        """Stop the rollout engine (and any processes it owns)."""
        self.engine.close()
