"""Runs on every rank: Tinker's primitives on the FSDP actor with LoRA adapters and a rollout engine.

The controller (:class:`rlkit.TrainingClient`) calls these through :class:`rlkit.runtime.RoleGroup`, one call at a
time in the order they were queued. Gradients accumulate over ``forward_backward`` calls until ``optim_step``; the
engine samples the weights of the last ``sync_engine`` (Tinker's ``save_weights_for_sampler``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlkit import diagnostics
from rlkit.algos.tinker_losses import tinker_token_loss
from rlkit.config import OptimConfig
from rlkit.config.primitives import PrimitivesConfig
from rlkit.data.datum import DatumRows, rows_problems
from rlkit.fsdp import param_dtype
from rlkit.models import load_tokenizer
from rlkit.models.head import response_head
from rlkit.models.loading import model_limits
from rlkit.models.logprobs import sampled_logprobs
from rlkit.rollout import SamplingParams, build_engine
from rlkit.runtime.errors import CollectiveAbandoned
from rlkit.workers.actor import ActorRole
from rlkit.workers.batches import micro_batch_positions
from rlkit.workers.lora import engine_weights

T = TypeVar("T")


@dataclass(kw_only=True)
class AdamStep:
    """One optimizer step's hyperparameters (Tinker's AdamParams): AdamW with decoupled weight decay."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Clip the true global gradient norm to this; 0: no clip."""

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r}: {rule}" for name, value, ok, rule in (
            ("learning_rate", self.learning_rate, 0 < self.learning_rate < math.inf, "must be positive and finite"),
            ("beta1", self.beta1, 0 <= self.beta1 < 1, "must be in [0, 1)"),
            ("beta2", self.beta2, 0 <= self.beta2 < 1, "must be in [0, 1)"),
            ("eps", self.eps, 0 < self.eps < math.inf, "must be positive and finite"),
            ("weight_decay", self.weight_decay, 0 <= self.weight_decay < math.inf, "must be >= 0 and finite"),
            ("grad_clip_norm", self.grad_clip_norm, 0 <= self.grad_clip_norm < math.inf, "must be >= 0 (0: no clip)"),
        ) if not ok]  # fmt: skip
        if problems:
            raise ValueError("AdamStep: " + "; ".join(problems))


@dataclass(kw_only=True)
class ForwardResult:
    """One rank's share of a ``forward``/``forward_backward``."""

    logprobs: list[torch.Tensor]
    """One [N] float32 tensor per datum of this rank: the learner's log-probs of its ``target_tokens``."""
    loss_sum: float
    """The sum of this rank's per-token losses."""


@dataclass(kw_only=True)
class OptimResult:
    """What an optimizer step did (the same on every rank)."""

    grad_norm: float
    """The true global gradient norm before clipping."""
    step: int
    """Optimizer steps taken so far."""


@dataclass(kw_only=True)
class SampledRows:
    """``n`` completions of one prompt from this rank's engine (none on ranks given no prompt)."""

    response_ids: torch.Tensor
    """[n, T] int64, padded after the end."""
    response_mask: torch.Tensor
    """[n, T] float32, 1 on generated tokens."""
    logprobs: torch.Tensor
    """[n, T] float32, the engine's log-probs of the sampled tokens (0 past the end)."""
    finish_reason: list[str] = field(default_factory=list)
    """"stop" or "length" per completion."""


class DataRefused(ValueError):
    """A rank's data broke the model's limits: raised on that rank, and :class:`PeerRefused` on the others."""


class PeerRefused(ValueError):
    """Another rank refused this call's data (its :class:`DataRefused` says why)."""


class PeerFailed(RuntimeError):
    """Another rank raised between the collectives of this call: every rank ends it (see ``_agreed``)."""


def _in_collectives(what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, which holds collectives (an FSDP forward or backward): an error in it, on one rank, leaves the
    others waiting in one, so it is raised as :class:`CollectiveAbandoned` (the controller stops them at once)."""
    try:
        return fn(*args)
    except Exception as exc:
        raise CollectiveAbandoned(f"{type(exc).__name__}: {exc} (in {what}, where the other ranks wait in its "
                                  "collectives)") from exc  # fmt: skip


class PrimitivesWorker(ActorRole):
    """One rank's share of a Tinker-style training client: the LoRA actor and AdamW, and a whole rollout engine."""

    def __init__(self, config: PrimitivesConfig, model_dir: str | Path):
        super().__init__(
            model_dir,
            seed=config.seed,
            fsdp=config.fsdp,
            optim=OptimConfig(lr=1e-4, max_grad_norm=0.0),  # each optim_step sets its own hyperparameters
            optimizer_steps=1,
            reference=False,
            trust_remote_code=config.trust_remote_code,
            lora=config.lora,
        )
        self.config = config
        self.limits = model_limits(self.model_dir)
        tokenizer = load_tokenizer(self.model_dir, trust_remote_code=config.trust_remote_code)
        self.engine = build_engine(
            config.rollout,
            self.model_dir,
            device=self.device,
            dtype=param_dtype(config.fsdp, self.device.type),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_num_seqs=config.max_samples,
            max_prompt_tokens=config.max_prompt_tokens,
            seed=config.seed,
            trust_remote_code=config.trust_remote_code,
            adapters=self.lora if config.rollout.lora_sync == "adapter" else None,
        )
        engine_model = getattr(self.engine, "model", None)
        self.memory = self._memory_tracker(engine_model if isinstance(engine_model, torch.nn.Module) else None)
        self.pending = 0
        """``forward_backward`` calls whose gradients wait for the next optimizer step."""
        self.steps = 0
        self.sync_engine()  # the engine starts with the actor's own adapters

    def forward_backward(
        self, rows: DatumRows, loss_fn: str, loss_fn_config: Mapping[str, float] | None, backward: bool
    ) -> ForwardResult:
        """Tinker's loss of this rank's rows [b, N] (a sum over tokens), its backward with ``backward`` (gradients add
        to those of earlier calls; FSDP sums them over ranks), and each datum's target log-probs. The rows go through
        the model ``micro_batch_size`` at a time (every rank makes as many passes: the shares are equal), each
        through the fused LM head (:mod:`rlkit.models.head`) where the model has one: no [b, N, V] logits.

        Every rank checks its rows against the model's limits and the ranks agree before the first forward
        (:meth:`_agree`), so bad data raises on all of them together instead of leaving some in a collective. An
        error between the collective-bearing phases (a micro-batch's slicing, its loss) is agreed on the same way
        before the next phase (:meth:`_agreed`), and with ``backward`` drops the gradients accumulated since the last
        optimizer step; one inside a forward or backward raises :class:`CollectiveAbandoned` (the other ranks wait
        in its collectives: the controller stops them)."""
        self._agree(rows_problems(rows, self.limits.vocab_size, self.limits.context))
        if backward and self.pending == 0:
            self.memory.reset()
        rows = rows.to(self.device)
        logprobs = torch.zeros(rows.mask.shape, device=self.device)
        loss_sum = 0.0
        micros = micro_batch_positions(torch.tensor(rows.lengths), self.config.micro_batch_size)
        try:
            with self.actor.accumulation(micros) as steps, torch.set_grad_enabled(backward):
                for index in steps:
                    micro = self._agreed("slicing a micro-batch", rows.rows, int(index[0]), int(index[-1]) + 1)
                    micro_logprobs = _in_collectives("the forward", self._target_logprobs, micro)
                    loss, value = self._agreed("the loss", self._micro_loss, micro, micro_logprobs, loss_fn,
                                               loss_fn_config, logprobs, index)  # fmt: skip
                    loss_sum += value
                    if backward:
                        _in_collectives("the backward", loss.backward)
        except Exception:
            if backward:  # this call's share of the gradients may be partly in them: drop them all, on every rank
                self.actor.optimizer.zero_grad(set_to_none=True)
                self.pending = 0
            raise
        if backward:
            self.pending += 1
            self.memory.mark("forward_backward")
        kept = [logprobs[i, :n].cpu() for i, n in enumerate(rows.lengths) if n > 0]
        return ForwardResult(logprobs=kept, loss_sum=loss_sum)

    def _micro_loss(self, rows: DatumRows, logprobs: torch.Tensor, loss_fn: str,
                    loss_fn_config: Mapping[str, float] | None, into: torch.Tensor,
                    index: torch.Tensor) -> tuple[torch.Tensor, float]:  # fmt: skip
        """One micro-batch's loss: Tinker's per-token loss of its ``logprobs`` [b, N], summed (a scalar tensor), and
        its value; the log-probs go into rows ``index`` [b] of ``into`` [B, N]."""
        into[index.to(self.device)] = logprobs.detach().float()
        loss = tinker_token_loss(loss_fn, logprobs, rows.inputs, rows.mask, loss_fn_config).sum()
        return loss, float(loss.detach())

    def _failed_ranks(self, failed: bool) -> list[int]:
        """Every rank says whether it failed (one all-reduce of a flag per rank); the ranks that did."""
        flags = torch.zeros(self.world_size, device=self.device)
        flags[self.rank] = float(failed)
        dist.all_reduce(flags)
        return [int(r) for r in flags.nonzero().flatten().tolist()]

    def _agree(self, problems: list[str]) -> None:
        """Raise on every rank when any rank has ``problems`` (before any other collective of the call):
        :class:`DataRefused` where they are, :class:`PeerRefused` elsewhere."""
        refused = self._failed_ranks(bool(problems))
        if problems:
            raise DataRefused(f"rank {self.rank}'s share: " + "; ".join(problems))
        if refused:
            raise PeerRefused(f"ranks {refused} refused their share of the data")

    def _agreed(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, which holds no collective, then the ranks agree whether it raised anywhere: if so the call
        ends on every rank, with its own error where it raised and :class:`PeerFailed` elsewhere."""
        error = None
        try:
            value = fn(*args)
        except Exception as exc:  # noqa: BLE001 - raised again below, once the ranks know
            error = exc
        failed = self._failed_ranks(error is not None)
        if error is not None:
            raise error
        if failed:
            raise PeerFailed(f"ranks {failed} failed in {what}")
        return value

    def _target_logprobs(self, rows: DatumRows) -> torch.Tensor:
        """[b, N] log-probs (temperature 1) of ``rows.target_tokens`` under the actor; 0 on padding. With a
        :class:`~rlkit.models.head.ResponseHead` only the real positions' log-probs are computed, chunk by chunk."""
        mask = rows.mask.long()
        kwargs = {"input_ids": rows.input_ids, "attention_mask": mask, "use_cache": False,
                  "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}  # fmt: skip
        head = response_head(self.actor.model)
        if head is None:
            logprobs, _ = sampled_logprobs(self.actor.model(**kwargs).logits, rows.target_tokens, 1.0)
            return logprobs * rows.mask
        real = rows.mask.flatten().nonzero().squeeze(1)
        with head.scoring(real, rows.target_tokens.flatten()[real], 1.0, "none"):
            out = self.actor.model(**kwargs).logits  # [M, 2]: log-prob, entropy (0)
        return out.new_zeros(rows.mask.numel()).scatter(0, real, out[:, 0]).view(rows.mask.shape)

    def optim_step(self, adam: AdamStep) -> OptimResult:
        """One AdamW step with ``adam``'s hyperparameters on the accumulated gradients, then zero them; the gradient
        report of ``grad_norms()`` is this step's."""
        for group in self.actor.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)  # fmt: skip
        self.actor.scheduler.base_lrs = [adam.learning_rate] * len(self.actor.optimizer.param_groups)
        report = diagnostics.grad_report(self.actor.model)
        norm = self.actor.clip_and_step(adam.grad_clip_norm)
        self.actor.optimizer.zero_grad(set_to_none=True)
        self.memory.mark("optimizer_step")
        self.steps += 1
        self.pending = 0
        self.grads = dataclasses.replace(report, global_norm=norm)
        return OptimResult(grad_norm=norm, step=self.steps)

    def sync_engine(self) -> int:
        """The actor's adapters (or merged weights: ``rollout.lora_sync``) into this rank's engine; the count loaded."""
        count = self.engine.load_weights(engine_weights(self.actor.model, self.lora, self.config.rollout.lora_sync))
        self.memory.mark("weight_sync")
        return count

    def sample(self, prompt_ids: torch.Tensor, params: SamplingParams) -> SampledRows:
        """``params.n`` completions of ``prompt_ids`` [1, P] ([0, P]: nothing, on the ranks that do not sample)."""
        width = params.max_new_tokens
        if len(prompt_ids) == 0:
            empty = torch.zeros(0, width)
            return SampledRows(response_ids=empty.long(), response_mask=empty, logprobs=empty)
        ids = prompt_ids.to(self.device)
        gen = self.engine.generate(ids, torch.ones_like(ids), params)
        self.engine.sleep()
        self.memory.mark("rollout")
        return SampledRows(response_ids=gen.response_ids.cpu(), response_mask=gen.response_mask.cpu(),
                           logprobs=gen.logprobs.cpu(), finish_reason=gen.finish_reason)  # fmt: skip

    def save_state(self, directory: str) -> None:
        """This rank's shards of the adapters and AdamW's moments, its schedule and RNG (:meth:`ActorRole.save`);
        gradients accumulated since the last optimizer step are not saved."""
        self.save(directory, export_hf_weights=False)

    def load_state(self, directory: str, optimizer: bool, steps: int) -> None:
        """Restore :meth:`save_state`'s adapters, with ``optimizer`` AdamW's moments too (else a fresh AdamW), and the
        step count ``steps``; gradients accumulated since the last optimizer step are dropped."""
        self.load(directory)
        if not optimizer or steps == 0:  # at step 0 the saved moments are the zeros of torch's placeholder step
            self.actor.optimizer.state.clear()
        self.actor.optimizer.zero_grad(set_to_none=True)
        self.pending, self.steps = 0, steps

    def others(self) -> dict[str, torch.nn.Module]:
        engine = getattr(self.engine, "model", None)
        return {"engine": engine} if isinstance(engine, torch.nn.Module) else {}

    def close(self) -> None:
        super().close()
        self.engine.close()
