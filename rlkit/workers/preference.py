"""Runs on every rank: the preference role (DPO, KTO), holding the FSDP policy, its optimizer and the frozen reference.

The controller (:class:`rlkit.PreferenceTrainer`) calls ``preference.call(PreferenceWorker.update, PerRank(rows))``
through :class:`rlkit.runtime.RoleGroup`. There is no rollout engine: the completions come from the data.
All ranks hold equally many rows and so run the same number of forward passes, as FSDP's collectives require.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit import diagnostics
from rlkit.algos import Mean, dpo_loss, kto_kl_baseline, kto_loss, kto_sums, preference_sums
from rlkit.config import DPOConfig, KTOConfig, PreferenceConfig
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import can_pack
from rlkit.workers.actor import ActorRole
from rlkit.workers.batches import PreferenceRows, global_counts, micro_batches
from rlkit.workers.messages import PreferenceResult, PreferenceScores
from rlkit.workers.metrics import MetricSums

logger = logging.getLogger(__name__)


class PreferenceWorker(ActorRole):
    """Runs on every rank: one rank's share of the policy being tuned on preferences (sharded policy + AdamW,
    sharded frozen reference unless reference-free DPO)."""

    def __init__(self, config: PreferenceConfig, model_dir: str | Path):
        super().__init__(
            model_dir,
            seed=config.seed,
            fsdp=config.fsdp,
            optim=config.optim,
            optimizer_steps=config.steps,
            reference=config.needs_reference,
            trust_remote_code=config.trust_remote_code,
        )
        self.config = config

    def update(self, rows: PreferenceRows, mismatched: PreferenceRows | None = None) -> PreferenceResult:
        """One optimizer step on this rank's rows (DPO: pairs as row 2i chosen, 2i + 1 rejected; KTO: examples).

        ``mismatched`` (KTO): this rank's share of the batch's mismatched pairs (prompt i, completion i - 1),
        for the KL baseline z_ref. The loss is the mean of the per-example losses over the whole batch on all
        ranks, whatever the micro-batch size: each micro-batch's loss sum is divided by the batch's example
        count over all ranks, and FSDP sums (not averages) the ranks' gradients.
        """
        cfg, actor, per_example = self.config, self.actor, self.config.sequences_per_example
        self.clock.start()
        self.memory.reset()
        rows = rows.to(self.device)
        sums = MetricSums(self.device)
        with self.clock.timed("reference"):  # KTO's baseline forward of the policy included
            # 1. the frozen reference's summed log-probs of every completion, once per batch (none: reference-free)
            reference_logps = None if self.reference is None else self._scored_logps(self.reference, rows)
            # KTO: the KL baseline z_ref over all ranks' mismatched pairs, under the policy before this step
            z_ref = None if mismatched is None else self._kl_baseline(mismatched.to(self.device))
        self.memory.mark("reference")
        # 2. the loss normaliser: the batch's examples over all ranks (every completion has >= 1 token)
        num_examples = (global_counts(rows.response_mask)[1] / per_example).float()
        actor.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        policy_parts = []
        with self.clock.timed("update"):
            for index, micro in micro_batches(rows, cfg.micro_batch_size * per_example):
                # 3. the policy's summed log-probs of the micro-batch's completions, with gradient
                policy_logps = self._summed_logps(actor.model, micro)
                micro_reference_logps = None if reference_logps is None else reference_logps[index.to(self.device)]
                # 4. the per-example losses and the implicit rewards (pure math in rlkit.algos)
                losses, micro_metrics = self._losses(policy_logps, micro_reference_logps, micro, z_ref)
                # 5. backward of this micro-batch's share of the batch mean; FSDP sums it with the other ranks'
                loss = losses.sum() / num_examples
                loss.backward()
                sums.add(micro_metrics)
                step_loss += loss.detach()
                policy_parts.append(policy_logps.detach())
            # 6. the gradient report, the clip by the true global norm, the optimizer and schedule step
            self.memory.mark("forward_backward")
            report = diagnostics.grad_report(actor.model)
            norm = actor.clip_and_step(cfg.optim.max_grad_norm)
            self.memory.mark("optimizer_step")
        # this rank's part of the step's loss; the norm and z_ref are the same on every rank
        sums.add({"actor/loss": Mean(step_loss, 1 / self.world_size), "actor/grad_norm": Mean(norm, 1)})
        if z_ref is not None:
            sums.add({"kto/z_ref": Mean(z_ref, 1)})
        metrics = {**sums.reduce(), "actor/lr": actor.lr, "actor/skipped_steps": float(not math.isfinite(norm))}
        if z_ref is not None:  # a difference of two means over different examples, so made from the reduced ones
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        self.grads = dataclasses.replace(report, global_norm=float(norm), loss=metrics["actor/loss"])
        return PreferenceResult(
            metrics=metrics,
            policy_logps=torch.cat(policy_parts).cpu(),
            reference_logps=None if reference_logps is None else reference_logps.cpu(),
            times=dict(self.clock.times),
            memory_mb=self.memory.memory_mb(),
        )

    @torch.no_grad()
    def evaluate(self, rows: PreferenceRows, mismatched: PreferenceRows | None = None) -> PreferenceScores:
        """The per-example losses and implicit rewards of this rank's held-out rows under the policy; no update.

        ``mismatched`` (KTO): this rank's share of the held-out set's mismatched pairs, for its z_ref.
        """
        rows = rows.to(self.device)
        # 1. the frozen reference's and the policy's summed log-probs of every completion
        reference_logps = None if self.reference is None else self._scored_logps(self.reference, rows)
        policy_logps = self._scored_logps(self.actor.model, rows)
        # 2. KTO's KL baseline over all ranks' mismatched pairs
        z_ref = None if mismatched is None else self._kl_baseline(mismatched.to(self.device))
        # 3. the losses and rewards (pure math in rlkit.algos)
        losses, rewards = self._example_losses(policy_logps, reference_logps, rows, z_ref)
        return PreferenceScores(losses=losses.float().cpu(), rewards=rewards.float().cpu(),
                                z_ref=None if z_ref is None else float(z_ref))  # fmt: skip

    def _losses(
        self,
        policy_logps: torch.Tensor,
        reference_logps: torch.Tensor | None,
        micro: PreferenceRows,
        z_ref: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, Mean]]:
        """Per-example losses [b] (with gradient) and the named metric sums of one micro-batch."""
        losses, rewards = self._example_losses(policy_logps, reference_logps, micro, z_ref)
        if isinstance(self.config, DPOConfig):
            pairs = len(losses)
            return losses, {
                **preference_sums(rewards[:, 0], rewards[:, 1]),
                "logps/chosen": Mean(policy_logps[0::2].detach().sum(), pairs),
                "logps/rejected": Mean(policy_logps[1::2].detach().sum(), pairs),
            }
        assert z_ref is not None
        return losses, kto_sums(rewards[:, 0], micro.filled("desirable"), z_ref, self.config.beta)

    def _example_losses(
        self,
        policy_logps: torch.Tensor,
        reference_logps: torch.Tensor | None,
        rows: PreferenceRows,
        z_ref: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example losses [b] (with gradient when the log-probs have it) and implicit rewards [b, k] (detached;
        DPO: chosen, rejected; KTO: the completion's).

        Args:
            policy_logps, reference_logps: [b * sequences_per_example] summed completion log-probs of the rows.
            rows: the rows (KTO's labels in ``desirable``); z_ref: KTO's KL baseline.
        """
        cfg = self.config
        if isinstance(cfg, DPOConfig):
            reference_chosen = None if reference_logps is None else reference_logps[0::2]
            reference_rejected = None if reference_logps is None else reference_logps[1::2]
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                policy_logps[0::2], policy_logps[1::2], reference_chosen, reference_rejected, beta=cfg.beta,
                loss=cfg.loss, label_smoothing=cfg.label_smoothing, reference_free=cfg.reference_free,
            )  # fmt: skip
            return losses, torch.stack([chosen_rewards, rejected_rewards], dim=1)
        assert isinstance(cfg, KTOConfig) and reference_logps is not None and z_ref is not None
        losses, rewards = kto_loss(
            policy_logps, reference_logps, rows.filled("desirable"), z_ref, beta=cfg.beta,
            desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight,
        )  # fmt: skip
        return losses, rewards.unsqueeze(1)

    def _kl_baseline(self, mismatched: PreferenceRows) -> torch.Tensor:
        """KTO's z_ref over every rank's mismatched pairs ([m] rows here, as many on each rank), no gradient."""
        policy_kl_logps = self._scored_logps(self.actor.model, mismatched)
        reference_kl_logps = self._scored_logps(self.reference, mismatched)
        local = torch.stack([policy_kl_logps, reference_kl_logps])
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        every_rank = torch.cat(gathered, dim=1)
        return kto_kl_baseline(every_rank[0], every_rank[1])

    # -- log-probs -----------------------------------------------------------------------------

    def _summed_logps(self, model: torch.nn.Module, rows: PreferenceRows) -> torch.Tensor:
        """[n] each row's summed completion log-probs under ``model`` (with gradient when called under grad)."""
        logprobs, _ = response_logprobs(
            model,
            rows.input_ids,
            rows.attention_mask,
            response_width=rows.response_mask.shape[1],
            temperature=1.0,
            padding_free=can_pack(model),
        )
        return logprobs.sum(dim=1)  # 0 at padded completion positions

    @torch.no_grad()
    def _scored_logps(self, model: torch.nn.Module | None, rows: PreferenceRows) -> torch.Tensor:
        """[n] :meth:`_summed_logps` without gradient, in micro-batches of the update's size."""
        assert model is not None
        size = self.config.micro_batch_size * self.config.sequences_per_example
        return torch.cat([self._summed_logps(model, micro) for _, micro in micro_batches(rows, size)])
