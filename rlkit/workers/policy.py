"""Runs on every rank: the policy role, holding the FSDP actor, the frozen reference and the rollout engine.

The controller (:class:`rlkit.Trainer`) calls its methods through
:class:`rlkit.runtime.RoleGroup`, e.g. ``policy.call(PolicyWorker.update, PerRank(rows))``.
All ranks run the same number of forward passes per phase (equal shards, equal micro-batches),
as FSDP's collectives require.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from rlkit import diagnostics
from rlkit.algos import (
    Correction,
    Mean,
    PolicyLossFn,
    PolicyLossSettings,
    PolicyObjective,
    loss_weights,
    policy_objective,
)
from rlkit.config import RLConfig
from rlkit.data.agents import Agent
from rlkit.data.chat import ChatRenderer
from rlkit.diagnostics.rescore import Rescored
from rlkit.fsdp import param_dtype
from rlkit.models import load_tokenizer
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import can_pack
from rlkit.rollout import SamplingParams, build_engine
from rlkit.rollout.base import Generation
from rlkit.rollout.calls import CallRunner
from rlkit.rollout.episodes import EpisodeInput, Episodes, run_episodes
from rlkit.workers.actor import ActorRole
from rlkit.workers.batches import PolicyRows, Rows, global_counts, in_micro_batches, micro_batches, mini_batches
from rlkit.workers.lora import engine_weights
from rlkit.workers.messages import RolloutResult, SampleResult, UpdateResult
from rlkit.workers.metrics import MetricSums
from rlkit.workers.mismatch import probe_mismatch

logger = logging.getLogger(__name__)


class PolicyWorker(ActorRole):
    """One rank's share of the policy: sharded actor + optimizer, sharded reference, whole rollout engine."""

    def __init__(
        self,
        config: RLConfig,
        model_dir: str | Path,
        policy_loss_fn: PolicyLossFn | None = None,
        agent: Agent | None = None,
    ):
        """``agent``: the tools, environment and limits of a multi-turn run (None: single-turn completions)."""
        super().__init__(
            model_dir,
            seed=config.seed,
            fsdp=config.fsdp,
            optim=config.optim,
            optimizer_steps=config.steps * config.ppo_epochs * config.mini_batches,
            reference=config.kl_coef > 0,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation,
            lora=config.lora,
        )
        self.config = config
        tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self.agent = agent
        self.renderer = None if agent is None else ChatRenderer(tokenizer, agent.schemas)
        self.engine = build_engine(
            config.rollout,
            self.model_dir,
            device=self.device,
            dtype=param_dtype(config.fsdp, self.device.type),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_num_seqs=config.samples_per_step // self.world_size,
            max_prompt_tokens=config.data.max_prompt_tokens,
            seed=config.seed,
            trust_remote_code=config.trust_remote_code,
            adapters=self.lora if config.rollout.lora_sync == "adapter" else None,
        )
        self.calls = None if agent is None else CallRunner()  # after the engine: its thread is not forked with it
        """The event loop of every rollout's tool calls and environment methods on this worker."""
        estimate = _rank_estimate(config, self.actor.model, self.world_size, self.device)
        self.actor.keep_unsharded = estimate is not None and estimate.keep_unsharded
        if estimate is not None and estimate.engine_awake and hasattr(self.engine, "sleep_policy"):
            self.engine.sleep_policy.expect(estimate.trainer_bytes)  # awake from the first update, as planned
        self.engine_synced_at = 0
        """The optimizer step whose weights the engine holds (it starts with the model directory's, step 0)."""
        engine_model = getattr(self.engine, "model", None)
        self.memory = self._memory_tracker(engine_model if isinstance(engine_model, torch.nn.Module) else None)
        self.objective = PolicyObjective(
            policy_loss=config.policy_loss,
            loss=PolicyLossSettings(
                clip_eps=config.clip_eps,
                clip_high=config.clip_high,
                dual_clip=config.dual_clip,
                log_ratio_clamp=config.log_ratio_clamp,
                sapo_tau_pos=config.sapo_tau_pos,
                sapo_tau_neg=config.sapo_tau_neg,
            ),
            kl_coef=config.kl_coef if config.kl_mode == "loss" else 0.0,
            kl_estimator=config.kl_estimator,
            kl_clamp=config.kl_clamp,
            entropy_coef=config.entropy_coef,
            policy_loss_fn=policy_loss_fn,
            correction=Correction(**dataclasses.asdict(config.rollout_correction)),
        )

    # -- the phases of a step ------------------------------------------------------------------

    def rollout(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int, episodes: list[EpisodeInput] | None = None
    ) -> RolloutResult:
        """Generate ``group_size`` completions of this rank's prompts, then score them with the actor and reference.

        Args:
            prompt_ids, prompt_mask: [N, P] left-padded prompts of this rank.
            seed: the sampling seed of this rank and step.
            episodes: a multi-turn run's N prompts as messages and fields: trajectories instead of completions.
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
            gen = self._generate(prompt_ids, prompt_mask, params, episodes)
        self.memory.mark("rollout")
        with self.clock.timed("engine_sleep"):
            self.engine.sleep()  # hybrid engine: free its memory for the actor until the next sync
        self.memory.restart_peak()  # the weight-sync buffers the engine just freed are the rollout's, not scoring's
        attended = gen.response_attention if isinstance(gen, Episodes) else gen.response_mask.long()
        input_ids = torch.cat([prompt_ids.repeat_interleave(cfg.group_size, dim=0), gen.response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.repeat_interleave(cfg.group_size, dim=0), attended], 1)
        old_logprobs = ref_logprobs = None
        if cfg.recompute_logprobs:
            with self.clock.timed("logprobs"):
                old_logprobs = self._scored_logprobs(self.actor.model, input_ids, attention_mask)
            self.memory.mark("actor_logprobs")
        with self.reference_model() as reference:
            if reference is not None:
                with self.clock.timed("reference"):
                    ref_logprobs = self._scored_logprobs(reference, input_ids, attention_mask)
        if ref_logprobs is not None:
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
            memory_mb=self.memory.memory_mb(),
            **_trajectory_fields(gen),
        )

    def _generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, episodes: list | None
    ) -> Generation:
        """The engine's completions, or with ``episodes`` the trajectories of a multi-turn run (their loop's own
        times join this call's)."""
        if episodes is None:
            return self.engine.generate(prompt_ids, prompt_mask, params)
        if self.agent is None or self.renderer is None:
            raise ValueError("trajectories need the worker's agent: build PolicyWorker with agent=...")
        first_row = self.rank * len(prompt_ids) * params.n
        gen = run_episodes(self.engine, self.renderer, self.agent, episodes, prompt_ids, prompt_mask, params,
                           first_row=first_row, runner=self.calls)  # fmt: skip
        self.clock.times.update(gen.times)
        return gen

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> SampleResult:
        """Completions of this rank's prompts ([N, P], left-padded; N may be 0) under ``params``, nothing else:
        the validation pass. The engine sleeps again afterwards when it sleeps during updates."""
        self.clock.start()
        width = params.max_new_tokens
        if len(prompt_ids) == 0 and self.config.rollout.tensor_parallel_size == 1:  # a group's engine needs every rank
            empty = torch.zeros(0, width)
            return SampleResult(response_ids=empty.long(), response_mask=empty, finish_reason=[])
        none = dataclasses.replace(params, logprob_rows=())  # it returns no log-probs: the engine takes none
        with self.clock.timed("generate"):
            gen = self.engine.generate(prompt_ids.to(self.device), prompt_mask.to(self.device), none)
        self.engine.sleep()
        return SampleResult(
            response_ids=gen.response_ids.cpu(),
            response_mask=gen.response_mask.cpu(),
            finish_reason=gen.finish_reason,
            times=dict(self.clock.times),
            memory_mb=self.memory.memory_mb(),
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
        # no old log-probs from the rollout (recompute_logprobs=False): see _old_logprobs
        scored = torch.zeros_like(rows.response_mask) if rows.old_logprobs is None else None
        mini_size = len(rows) // cfg.mini_batches
        skipped = 0  # optimizer steps skipped on a non-finite gradient norm (every rank alike)
        with self.clock.timed("update"):
            for epoch in range(cfg.ppo_epochs):
                for m, mini in enumerate(mini_batches(rows, cfg.mini_batches)):
                    # 1. the loss normalisers: the whole mini-batch's token and sequence counts over all ranks
                    num_tokens, num_seqs = global_counts(mini.response_mask)
                    actor.optimizer.zero_grad(set_to_none=True)
                    step_loss = torch.zeros((), device=self.device)
                    micros = micro_batches(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
                    with actor.accumulation(micros) as steps:  # FSDP gathers and reduces once per step if it fits
                        for index, micro in steps:
                            # 2. the current policy's log-probs of the sampled tokens (and the entropy)
                            new_logprobs, entropy = self._new_logprobs(micro)
                            place = m * mini_size + index.to(self.device) if epoch == 0 else None
                            old_logprobs = _old_logprobs(micro, new_logprobs, scored, place)
                            # 3. the objective (rlkit.algos), with the engine-vs-trainer gap and its correction
                            weights = loss_weights(
                                micro.response_mask, cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                horizon=horizon,
                            )  # fmt: skip
                            loss, micro_metrics = policy_objective(
                                new_logprobs, old_logprobs, micro.advantages, micro.response_mask, weights,
                                self.objective, ref_logprobs=micro.ref_logprobs, entropy=entropy,
                                rollout_logprobs=micro.rollout_logprobs,
                            )  # fmt: skip
                            # 4. backward: FSDP sums this rank's gradients with the other ranks' (at the last one)
                            loss.backward()
                            sums.add(micro_metrics)
                            step_loss += loss.detach()
                    # 5. the gradient report, then the clip by the true global norm and the optimizer step
                    self.memory.mark("forward_backward")
                    report = diagnostics.grad_report(actor.model)
                    norm = actor.clip_and_step(cfg.optim.max_grad_norm)
                    skipped += not math.isfinite(norm)
                    self.memory.mark("optimizer_step")
                    # this rank's part of the step's loss; the norm is the same on every rank
                    sums.add({"actor/loss": Mean(step_loss, 1 / self.world_size), "actor/grad_norm": Mean(norm, 1)})
        # 6. the new weights into the rollout engine
        self.sync_engine()
        self.memory.mark("weight_sync")
        metrics = {**sums.reduce(), "actor/lr": actor.lr, "actor/skipped_steps": float(skipped)}
        self.grads = dataclasses.replace(report, global_norm=float(norm), loss=metrics["actor/loss"])
        old = None if scored is None else scored.cpu()
        report_memory = self.memory.memory_mb()
        return UpdateResult(metrics=metrics, old_logprobs=old, times=dict(self.clock.times), memory_mb=report_memory)

    def sync_engine(self) -> int:
        """Push the actor's full weights (LoRA: merged, or the adapters alone, as ``rollout.lora_sync`` says) into the
        rollout engine; returns how many tensors it loaded. The engine's sync step is stamped only when the engine
        confirms the load (it reports loading as many tensors as were sent); otherwise a warning, and
        ``trainer.mismatch()`` names the stale engine."""
        sent = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for pair in engine_weights(self.actor.model, self.lora, self.config.rollout.lora_sync):
                sent += 1
                yield pair

        with self.clock.timed("sync"):
            count = self.engine.load_weights(counted())
        if count == sent > 0:
            self.engine_synced_at = int(self.actor.scheduler.last_epoch)
        else:
            logger.warning("rank %d: the engine loaded %d of the %d tensors sent; it keeps the weights of optimizer "
                           "step %d", self.rank, count, sent, self.engine_synced_at)  # fmt: skip
        return count

    def mismatch_probe(self, rows: Rows) -> Rescored:
        """This rank's ``rows`` re-scored under the hypotheses of :mod:`rlkit.diagnostics.rescore`, with the weights'
        sums and the sync versions (``trainer.mismatch()``; a collective: every rank gets as many rows)."""
        return probe_mismatch(self, rows)

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
        """[B, T] response log-probs under ``model``, no grad, in the update's micro-batches (``micro_batch_size``
        rows, or ``max_tokens_per_micro_batch`` real tokens)."""
        cfg = self.config
        padding_free = cfg.padding_free and can_pack(model)

        def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            width, temperature = cfg.rollout.max_new_tokens, cfg.rollout.temperature
            return response_logprobs(model, ids, mask, response_width=width, temperature=temperature,
                                     padding_free=padding_free)[0]  # fmt: skip

        size, max_tokens = cfg.micro_batch_size, cfg.max_tokens_per_micro_batch
        return in_micro_batches(forward, input_ids, attention_mask, size, max_tokens)

    # -- diagnostics and checkpoints (the rest is ActorRole's) -----------------------------------

    def others(self) -> dict[str, torch.nn.Module]:
        """The reference and the rollout engine's own model (the hf engine's), for ``inspect``."""
        others = super().others()
        engine = getattr(self.engine, "model", None)
        if isinstance(engine, torch.nn.Module):
            others["engine"] = engine
        return others

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote, then sync the engine to the restored weights."""
        super().load(directory)
        self.sync_engine()

    def close(self) -> None:
        """Stop the rollout engine (and any processes it owns) and the tool calls' event loop."""
        super().close()
        self.engine.close()
        if self.calls is not None:
            self.calls.close()


def _old_logprobs(
    micro: PolicyRows, new_logprobs: torch.Tensor, scored: torch.Tensor | None, place: torch.Tensor | None
) -> torch.Tensor:
    """The ratio's old log-probs of ``micro`` [b, T]: the rollout's; or, none recomputed, this forward's, detached
    (one optimizer step per batch: the old policy itself; bypass mode: the engine is the old policy and the mask
    tests the current one, as verl's), kept in ``scored`` [n, T] at the rows ``place`` (the first epoch's)."""
    if scored is None:
        return micro.filled("old_logprobs")
    old = new_logprobs.detach()
    if place is not None:
        scored[place] = old
    return old


def _trajectory_fields(gen: Generation) -> dict:
    """What a trajectory adds to a RolloutResult (nothing for completions)."""
    if not isinstance(gen, Episodes):
        return {}
    return {
        "response_attention": gen.response_attention.cpu(),
        "turn_index": gen.turn_index.cpu(),
        "trajectories": gen.trajectories,
    }


def _rank_estimate(
    config: RLConfig, model: torch.nn.Module, world_size: int, device: torch.device
) -> diagnostics.MemoryEstimate | None:
    """The memory estimate this rank acts on (on a CPU the host's memory stands for the device's): whether the
    update keeps FSDP's units gathered through an optimizer step, whether vLLM stays awake; None for models the
    estimate cannot read."""
    gib = diagnostics.device_memory_gib() if device.type == "cuda" else psutil.virtual_memory().total / 2**30
    dtype = "bf16" if param_dtype(config.fsdp, device.type) == torch.bfloat16 else "fp32"
    try:
        return diagnostics.rank_estimate(config, model.config, world_size=world_size, device_memory_gib=gib,
                                         compute_dtype=dtype)
    except ValueError as err:  # a model config without a decoder's sizes
        logger.info("the update reshards FSDP's units every micro-batch: no memory estimate for this model (%s)", err)
        return None
