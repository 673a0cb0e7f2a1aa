"""Before launch: the config against the cluster and the model's family (:func:`check_launch`), the memory estimate
of a run config, and the lint findings it raises (no cluster, no weights).

    findings = preflight(cfg, world_size=8, device_memory_gib=139.8)   # reads cfg.model's config.json
    print(findings)                                                    # "memory-will-not-fit" with its fixes
    print(estimate_for(cfg, world_size=8, device_memory_gib=139.8))    # the whole table
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.config import ConfigError
from rlkit.config.typed import type_problems
from rlkit.diagnostics import rules
from rlkit.diagnostics.estimate import MemoryEstimate, estimate_memory
from rlkit.diagnostics.lint import SEVERITIES, Finding, Findings
from rlkit.diagnostics.memory_terms import MemorySetting, ModelShape
from rlkit.models import model_family_problems

if TYPE_CHECKING:
    from rlkit.config import PreferenceConfig, RLConfig


def check_launch(config: RLConfig | PreferenceConfig, world_size: int, device: str = "cpu", **placement: Any) -> None:
    """Raise ConfigError with every problem at once: the config against ``world_size`` ranks on ``device``
    (``config.cluster_problems``; ``placement``: its ``nodes`` and ``node_gpus`` for GRPO/PPO) and what the model's
    family lacks for FSDP and the rollout engine (``rlkit.models.model_family_problems``). Settings of the wrong type
    (set on the config after it was made: ``config.lora.rank = "8"``) are named first, all of them."""
    problems = type_problems(config)
    if not problems:
        problems = config.cluster_problems(world_size, device, **placement)
        problems += model_family_problems(config, device, world_size)
    if problems:
        raise ConfigError(problems)


def memory_setting(
    config: RLConfig, *, world_size: int, device_memory_gib: float, host_memory_gib: float = 0.0,
    ranks_per_host: int = 0,
) -> MemorySetting:
    """The estimate's knobs from a GRPOConfig / PPOConfig on a GPU cluster (param_dtype "auto" is bf16 there);
    ``host_memory_gib`` (0: unchecked) and ``ranks_per_host`` (0: all on one) for the host memory's check."""
    fsdp, rollout = config.fsdp, config.rollout
    padding_free, attention = config.padding_free, config.attn_implementation
    return MemorySetting(
        device_memory_gib=device_memory_gib,
        world_size=world_size,
        sharding=fsdp.sharding,
        hybrid_shard_size=fsdp.hybrid_shard_size,
        compute_dtype="fp32" if fsdp.param_dtype == "fp32" else "bf16",
        reduce_dtype=fsdp.reduce_dtype,
        reshard_after_forward=fsdp.reshard_after_forward,
        fsdp_version=fsdp.version,
        cpu_offload=bool(fsdp.cpu_offload),  # unset: off until a plan says otherwise
        activation_checkpointing=bool(fsdp.activation_checkpointing),
        compiled_layers=bool(fsdp.compile),
        prompt_tokens=config.data.max_prompt_tokens,
        response_tokens=rollout.max_new_tokens,
        samples_per_step=config.samples_per_step,
        mini_batches=config.mini_batches,
        micro_batch_size=config.micro_batch_size,
        max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        padding_free=padding_free,
        padding_mask=not padding_free and attention == "sdpa",  # prompts of different lengths: left padding
        reference=config.kl_coef > 0,
        critic=config.algorithm == "ppo",
        recompute_logprobs=config.recompute_logprobs,
        entropy_bonus=config.entropy_coef > 0,
        engine=rollout.engine,
        gpu_memory_utilization=rollout.engine_share,
        kv_cache_gib=rollout.kv_cache_gb,
        engine_sleep=rollout.sleep,
        lora_rank=config.lora.rank,
        lora_targets=config.lora.target_modules,
        lora_sync=rollout.lora_sync,
        host_memory_gib=host_memory_gib,
        ranks_per_host=ranks_per_host,
    )


def estimate_for(
    config: RLConfig,
    model_config: ModelShape | Mapping | str | Path | Any = None,
    *,
    world_size: int,
    device_memory_gib: float,
    host_memory_gib: float = 0.0,
    ranks_per_host: int = 0,
) -> MemoryEstimate:
    """:func:`estimate_memory` of ``config`` on ``world_size`` devices of ``device_memory_gib`` each.

    ``model_config``: a config.json dict, a PretrainedConfig, a ModelShape or a model directory; None reads
    ``config.model``'s config.json. ``host_memory_gib``, ``ranks_per_host``: as :func:`memory_setting`."""
    setting = memory_setting(config, world_size=world_size, device_memory_gib=device_memory_gib,
                             host_memory_gib=host_memory_gib, ranks_per_host=ranks_per_host)  # fmt: skip
    return estimate_memory(config.model if model_config is None else model_config, setting)


def rank_estimate(
    config: RLConfig,
    model_config: ModelShape | Mapping | str | Path | Any,
    *,
    world_size: int,
    device_memory_gib: float,
    compute_dtype: str,
) -> MemoryEstimate:
    """The estimate a rank acts on: ``config`` computing in ``compute_dtype`` ("bf16" or "fp32", what the rank uses:
    fp32 on CPU). Its ``keep_unsharded`` says whether the policy update keeps FSDP's units gathered through an
    optimizer step's micro-batches (``rlkit.fsdp.accumulate``), its ``engine_awake`` and ``trainer_bytes`` whether
    vLLM stays awake from the first update (``rlkit.rollout.sleep``)."""
    setting = memory_setting(config, world_size=world_size, device_memory_gib=device_memory_gib)
    return estimate_memory(model_config, dataclasses.replace(setting, compute_dtype=compute_dtype))


def preflight(
    config: RLConfig,
    model_config: ModelShape | Mapping | str | Path | Any = None,
    *,
    world_size: int,
    device_memory_gib: float,
    host_memory_gib: float = 0.0,
    ranks_per_host: int = 0,
) -> Findings:
    """Lint findings of ``config`` before anything launches: "memory-will-not-fit" when the estimate's peak
    exceeds the device, with the fixes; "host-memory-will-not-fit" when CPU offload and sleeping engines would
    take more than a host has (given ``host_memory_gib``). Arguments as :func:`estimate_for`."""
    est = estimate_for(config, model_config, world_size=world_size, device_memory_gib=device_memory_gib,
                       host_memory_gib=host_memory_gib, ranks_per_host=ranks_per_host)  # fmt: skip
    return estimate_findings(est)


def estimate_findings(est: MemoryEstimate) -> Findings:
    """The :data:`rules.PREFLIGHT` findings of an estimate (for ``trainer.lint()``, which has one already)."""
    items = [Finding(**raw._asdict()) for rule in rules.PREFLIGHT for raw in rule(est)]
    return Findings(sorted(items, key=lambda f: SEVERITIES.index(f.severity)))
