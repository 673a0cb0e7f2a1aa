"""Runs on every rank: the policy role's side of ``trainer.mismatch()`` (re-scoring, weight sums, sync versions).

The hypotheses and the sums are :mod:`rlkit.diagnostics.rescore`'s; the verdicts are made on the controller
(:mod:`rlkit.diagnostics.mismatch`).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from rlkit.config import LoraConfig, RLConfig
from rlkit.diagnostics.rescore import PROBE_ROWS, Rescored, engine_tensor_sums, rescore_rows, tensor_sums
from rlkit.fsdp import param_dtype
from rlkit.models.logprobs import response_logprobs
from rlkit.workers.batches import Rows
from rlkit.workers.lora import engine_weights
from rlkit.workers.training import TrainedModel

LOGIT_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "no_repeat_ngram_size")  # fmt: skip
"""Sampling settings that change the distribution sampled from (and so the engine's log-probs)."""


class Probed(Protocol):
    """What the probe reads of a rank's policy role (:class:`~rlkit.workers.policy.PolicyWorker`)."""

    @property
    def config(self) -> RLConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def actor(self) -> TrainedModel: ...
    @property
    def engine(self) -> object: ...
    @property
    def engine_synced_at(self) -> int: ...
    @property
    def lora(self) -> LoraConfig | None: ...


@torch.no_grad()
def probe_mismatch(worker: Probed, rows: Rows) -> Rescored:
    """``rows`` (this rank's, as many on every rank: the forwards are FSDP collectives) re-scored by the actor under
    every hypothesis, by the engine's own weights in fp32 where rlkit holds them, and the weights' sums."""
    cfg, model = worker.config, worker.actor.model
    rows = rows.to(worker.device)
    width, rollout = cfg.rollout.max_new_tokens, cfg.rollout
    parts: list[dict[str, torch.Tensor]] = []
    for start in range(0, len(rows), PROBE_ROWS):
        part = rows.select(slice(start, start + PROBE_ROWS))
        parts.append(rescore_rows(model, part.input_ids, part.attention_mask, width=width,
                                  temperature=rollout.temperature, top_p=rollout.top_p,
                                  min_new_tokens=rollout.min_new_tokens,
                                  eos_token_id=getattr(worker.engine, "eos_token_id", None)))  # fmt: skip
    scored = {name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]}
    engine_dtype, trainer_dtype = _engine_dtype(worker), _trainer_dtype(worker)
    result = Rescored(
        trainer=scored["trainer"],
        no_temperature=scored.get("no_temperature"),
        nucleus=scored.get("nucleus"),
        no_early_eos=scored.get("no_early_eos"),
        penalised={float(k.split("=")[1]): v for k, v in scored.items() if k.startswith("penalty=")},
        dtypes={"trainer": _name(trainer_dtype), "engine": _name(engine_dtype)},
        optimizer_steps=int(worker.actor.scheduler.last_epoch),
        engine_synced_at=worker.engine_synced_at,
        sampling=engine_sampling(worker.engine, rollout.temperature, rollout.top_p),
    )
    if engine_dtype.itemsize < trainer_dtype.itemsize:  # the engine computes in a lower precision
        with torch.autocast(device_type=worker.device.type, dtype=engine_dtype):
            result.engine_dtype = _scores(model, rows, width, rollout.temperature)
    engine_model = getattr(worker.engine, "model", None)
    if isinstance(engine_model, torch.nn.Module):
        upcast = copy.deepcopy(engine_model).float()
        result.engine_fp32 = _scores(upcast, rows, width, rollout.temperature)
    _add_sums(worker, result, engine_dtype)
    return result


def engine_sampling(engine: object, temperature: float, top_p: float) -> dict[str, object]:
    """The settings the engine samples with: rlkit's own, and the model's or the engine's defaults where they
    transform the logits (a transformers generation_config, vLLM's default SamplingParams)."""
    settings: dict[str, object] = {"temperature": temperature, "top_p": top_p}
    model = getattr(engine, "model", None)
    defaults = getattr(model, "generation_config", None)
    if defaults is not None:
        settings.update({k: v for k, v in defaults.to_diff_dict().items() if k in LOGIT_SETTINGS[2:]})
    llm = getattr(engine, "llm", None)
    if llm is not None:
        params = llm.get_default_sampling_params()
        settings.update({k: getattr(params, k) for k in LOGIT_SETTINGS[2:] if hasattr(params, k)})
    return settings


def _scores(model: torch.nn.Module, rows: Rows, width: int, temperature: float) -> torch.Tensor:
    """[n, T] log-probs of the rows' responses under ``model`` (plain forward), on the CPU."""
    parts = [
        response_logprobs(model, part.input_ids, part.attention_mask, response_width=width, temperature=temperature)[0]
        for part in (rows.select(slice(s, s + PROBE_ROWS)) for s in range(0, len(rows), PROBE_ROWS))
    ]
    return torch.cat(parts).float().cpu()


def _add_sums(worker: Probed, result: Rescored, engine_dtype: torch.dtype) -> None:
    """The trainer's and the engine's per-tensor sums (gathering the full weights is a collective), of the tensors a
    sync sends (LoRA: merged, or the adapters)."""
    trainer: dict[str, tuple[float, float]] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in engine_weights(worker.actor.model, worker.lora, worker.config.rollout.lora_sync):
        shapes[name] = list(tensor.shape)
        trainer.update(tensor_sums([(name, tensor)], engine_dtype))
    engine, result.unreadable = engine_tensor_sums(worker.engine, shapes)
    for name, (e_sum, e_sq, parts) in engine.items():
        t_sum = sum(trainer[p][0] for p in parts)
        t_sq = sum(trainer[p][1] for p in parts)
        result.checksums.append((name, t_sum, t_sq, e_sum, e_sq))


def _engine_dtype(worker: Probed) -> torch.dtype:
    model = getattr(worker.engine, "model", None)
    if isinstance(model, torch.nn.Module):
        return next(model.parameters()).dtype
    return getattr(worker.engine, "dtype", torch.float32)


def _trainer_dtype(worker: Probed) -> torch.dtype:
    return param_dtype(worker.config.fsdp, worker.device.type)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
