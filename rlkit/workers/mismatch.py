"""Runs on every rank: the policy role's side of ``trainer.mismatch()`` (the training forward's scores, the
hypotheses, the floor's reference, weight fingerprints, sync versions).

The hypotheses are :mod:`rlkit.diagnostics.rescore`'s, the fingerprints :mod:`rlkit.models.fingerprint`'s; the
verdicts are made on the controller (:mod:`rlkit.diagnostics.mismatch`, :mod:`rlkit.diagnostics.floor`).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from rlkit.config import LoraConfig, RLConfig, RolloutConfig
from rlkit.diagnostics.floor import DTYPE_FLOORS
from rlkit.diagnostics.rescore import PROBE_ROWS, Rescored, engine_fingerprints, rescore_rows
from rlkit.fsdp import param_dtype
from rlkit.models.fingerprint import differs, fingerprint
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import can_pack
from rlkit.rollout.base import LOGIT_SETTINGS, RolloutEngine, SamplingParams
from rlkit.workers.batches import Rows
from rlkit.workers.lora import engine_weights
from rlkit.workers.training import TrainedModel


class Probed(Protocol):
    """What the probe reads of a rank's policy role (:class:`~rlkit.workers.policy.PolicyWorker`)."""

    @property
    def config(self) -> RLConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def rank(self) -> int: ...
    @property
    def actor(self) -> TrainedModel: ...
    @property
    def engine(self) -> RolloutEngine: ...
    @property
    def engine_synced_at(self) -> int: ...
    @property
    def lora(self) -> LoraConfig | None: ...


@torch.no_grad()
def probe_mismatch(worker: Probed, rows: Rows) -> Rescored:
    """``rows`` (this rank's, as many on every rank: the forwards are FSDP collectives) scored by the actor through
    the training forward, re-scored under every hypothesis, scored by the floor's reference, and the weights'
    fingerprints on the trainer and inside the engine."""
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
    packed = cfg.padding_free and can_pack(model)
    result = Rescored(
        trainer=_scores(model, rows, width, rollout.temperature, packed),  # what the update's forward computes
        temperatures={float(k.split("=")[1]): v for k, v in scored.items() if k.startswith("temperature=")},
        temperature=rollout.temperature or 1.0,
        nucleus=scored.get("nucleus"),
        no_early_eos=scored.get("no_early_eos"),
        top_k={int(k.split("=")[1]): v for k, v in scored.items() if k.startswith("top_k=")},
        penalised={float(k.split("=")[1]): v for k, v in scored.items() if k.startswith("penalty=")},
        rank=worker.rank,
        dtypes={"trainer": _name(trainer_dtype), "engine": _name(engine_dtype)},
        optimizer_steps=int(worker.actor.scheduler.last_epoch),
        engine_synced_at=worker.engine_synced_at,
        sampling=engine_sampling(worker.engine, rollout),
    )
    with worker.engine.weights_awake():  # a sleeping vLLM engine's weights are unmapped: reading them faults
        reference = _compare_weights(worker, result, engine_dtype)
    if reference is not None:
        result.reference = _scores(reference, rows, width, rollout.temperature, False)
        result.reference_kind = f"a {_name(engine_dtype)} copy of the engine's model holding the trainer's weights"
        return result
    lower = engine_dtype.itemsize < trainer_dtype.itemsize  # an engine (vLLM) whose model rlkit does not hold
    with torch.autocast(device_type=worker.device.type, dtype=engine_dtype, enabled=lower):
        result.reference = _scores(model, rows, width, rollout.temperature, not packed)
    layout = "packed" if not packed else "padded"
    result.reference_kind = f"the trainer's {layout} forward" + (f" under {_name(engine_dtype)} autocast" * lower)
    if engine_dtype == trainer_dtype and engine_dtype.itemsize < 4:  # the reference repeats the trainer's rounding
        result.floor_minimum = DTYPE_FLOORS.get(_name(engine_dtype), 0.0)
        result.reference_kind += f" (the trainer's own {_name(engine_dtype)} arithmetic: the dtype's least floor)"
    return result


def engine_sampling(engine: object, rollout: RolloutConfig) -> dict[str, object]:
    """The settings the engine samples with for this rollout: the engine's own account where it gives one (the
    GenerationConfig transformers merges, the SamplingParams vLLM builds), else rlkit's and the model's or the
    engine's defaults where they transform the logits (a tensor-parallel group member)."""
    params = SamplingParams(n=1, max_new_tokens=rollout.max_new_tokens, min_new_tokens=rollout.min_new_tokens,
                            temperature=rollout.temperature, top_p=rollout.top_p, seed=0)  # fmt: skip
    effective = getattr(engine, "effective_sampling", None)
    if effective is not None:
        return effective(params)
    settings: dict[str, object] = {"temperature": rollout.temperature, "top_p": rollout.top_p}
    llm = getattr(engine, "llm", None)
    if llm is not None:
        defaults = llm.get_default_sampling_params()
        settings.update({k: getattr(defaults, k) for k in LOGIT_SETTINGS[2:] if hasattr(defaults, k)})
    return settings


def _scores(model: torch.nn.Module, rows: Rows, width: int, temperature: float, packed: bool) -> torch.Tensor:
    """[n, T] log-probs of the rows' responses under ``model`` (``packed``: padding-free), on the CPU."""
    parts = [
        response_logprobs(model, part.input_ids, part.attention_mask, response_width=width, temperature=temperature,
                          padding_free=packed)[0]  # fmt: skip
        for part in (rows.select(slice(s, s + PROBE_ROWS)) for s in range(0, len(rows), PROBE_ROWS))
    ]
    return torch.cat(parts).float().cpu()


def _compare_weights(worker: Probed, result: Rescored, engine_dtype: torch.dtype) -> torch.nn.Module | None:
    """Fill ``result.fingerprints``: each tensor a sync sends (LoRA: merged, or the adapters) fingerprinted on the
    trainer (gathered: a collective; cast to the engine's dtype) and inside the engine. Returns the floor's
    reference: a copy of the engine's model holding the trainer's weights (engines whose model rlkit holds)."""
    engine_model = getattr(worker.engine, "model", None)
    reference = copy.deepcopy(engine_model) if isinstance(engine_model, torch.nn.Module) else None
    trainer: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in engine_weights(worker.actor.model, worker.lora, worker.config.rollout.lora_sync):
        shapes[name] = list(tensor.shape)
        trainer[name] = fingerprint(tensor.to(engine_dtype))
        if reference is not None:
            reference.get_parameter(name).copy_(tensor)
    engine, result.unreadable = engine_fingerprints(worker.engine, shapes)
    result.fingerprints = [(f"{engine_name} ({name})" if engine_name != name else name, differs(trainer[name], values))
                           for name, (engine_name, values) in engine.items() if name in trainer]  # fmt: skip
    return reference


def _engine_dtype(worker: Probed) -> torch.dtype:
    model = getattr(worker.engine, "model", None)
    if isinstance(model, torch.nn.Module):
        return next(model.parameters()).dtype
    return getattr(worker.engine, "dtype", torch.float32)


def _trainer_dtype(worker: Probed) -> torch.dtype:
    return param_dtype(worker.config.fsdp, worker.device.type)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
