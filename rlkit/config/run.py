"""The run config (:class:`RLConfig` and its GRPO and PPO forms) and reading it from dicts and TOML."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
from rlkit.algos.aggregation import LOSS_AGG_MODES
from rlkit.algos.kl import KL_ESTIMATORS
from rlkit.config.checks import ConfigError, need
from rlkit.config.sections import (
    CheckpointConfig,
    CriticConfig,
    FSDPConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
)


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
        need(p, self.model != "", 'model="": give "tiny" or a local Hugging Face model directory')
        if self.model not in ("", "tiny") and not Path(self.model).is_dir():
            p.append(f'model="{self.model}": not "tiny" and not a local directory (nothing is downloaded)')
        need(p, self.steps >= 1, f"steps={self.steps}: must be >= 1")
        need(p, self.prompts_per_step >= 1, f"prompts_per_step={self.prompts_per_step}: must be >= 1")
        need(p, self.ppo_epochs >= 1, f"ppo_epochs={self.ppo_epochs}: must be >= 1")
        need(p, self.mini_batches >= 1, f"mini_batches={self.mini_batches}: must be >= 1")
        need(p, self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size}: must be >= 1")
        if not self.recompute_logprobs:
            need(
                p,
                self.ppo_epochs == 1 and self.mini_batches == 1,
                f"recompute_logprobs=False with ppo_epochs={self.ppo_epochs}, mini_batches={self.mini_batches}: "
                "later optimizer steps need the log-probs from before the first; "
                "set both to 1 or recompute_logprobs=True",
            )
            need(
                p,
                not (self.kl_mode == "reward" and self.kl_coef > 0),
                'recompute_logprobs=False with kl_mode="reward": the KL penalty needs the log-probs before '
                'the advantages; use kl_mode="loss" or recompute_logprobs=True',
            )
        p += self._algorithm_problems()
        need(p, 0 < self.clip_eps < 1, f"clip_eps={self.clip_eps}: must be in (0, 1), e.g. 0.2")
        need(
            p,
            self.clip_high is None or self.clip_high > 0,
            f"clip_high={self.clip_high}: must be > 0 (e.g. 0.28), or None for clip_eps",
        )
        need(
            p,
            self.dual_clip is None or self.dual_clip > 1,
            f"dual_clip={self.dual_clip}: must be > 1 (e.g. 3.0), or None to disable",
        )
        need(p, self.loss_agg in LOSS_AGG_MODES, f'loss_agg="{self.loss_agg}": use one of {LOSS_AGG_MODES}')
        need(p, self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef}: must be >= 0 (0 = no bonus)")
        need(p, self.kl_coef >= 0, f"kl_coef={self.kl_coef}: must be >= 0 (0 disables the reference)")
        need(p, self.kl_estimator in KL_ESTIMATORS, f'kl_estimator="{self.kl_estimator}": use one of {KL_ESTIMATORS}')
        need(p, self.kl_mode in ("loss", "reward"), f'kl_mode="{self.kl_mode}": use "loss" or "reward"')
        nested = self.rollout.problems() + self.optim.problems() + self.fsdp.problems() + self.checkpoint.problems()
        return p + nested + self.reward_model.problems()

    def _algorithm_problems(self) -> list[str]:
        """Checks of the advantage estimator and its settings."""
        p: list[str] = []
        need(
            p,
            self.advantage in ADVANTAGE_ESTIMATORS,
            f'advantage="{self.advantage}": use one of {list(ADVANTAGE_ESTIMATORS)} '
            "(or pass Trainer(advantage_fn=...))",
        )
        if self.advantage in GROUP_ESTIMATORS:
            need(
                p,
                self.group_size >= 2,
                f'group_size={self.group_size}: must be >= 2 with advantage="{self.advantage}" '
                "(advantages compare samples in a group)",
            )
        else:
            need(p, self.group_size >= 1, f"group_size={self.group_size}: must be >= 1")
        need(p, 0 <= self.gamma <= 1, f"gamma={self.gamma}: must be in [0, 1]")
        need(p, 0 <= self.lam <= 1, f"lam={self.lam}: must be in [0, 1]")
        return p

    def check_cluster(self, world_size: int, device: str = "cpu") -> None:
        """Raise ConfigError if the batch does not divide across ``world_size`` ranks, FSDP settings do not fit,
        or the model's family cannot be sharded or rolled out on ``device`` (rlkit.models.check_model_family)."""
        p: list[str] = self.fsdp.cluster_problems(world_size, device) + self.rollout.cluster_problems()
        p += self._model_family_problems(device)
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

    def _model_family_problems(self, device: str) -> list[str]:
        """What the model directory lacks for FSDP and the rollout engine (imports transformers, and vLLM for it)."""
        from rlkit.models.families import check_model_family
        from rlkit.models.tiny import TINY_MODEL_DIR

        model_dir = TINY_MODEL_DIR if self.model == "tiny" else Path(self.model)
        return check_model_family(
            model_dir, engine=self.rollout.engine, device=device, trust_remote_code=self.trust_remote_code
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-able), with ``algorithm`` naming the class for :func:`config_from_dict`."""
        return {"algorithm": self.algorithm, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        data = dict(data)
        algorithm = data.pop("algorithm", cls.algorithm)
        if algorithm != cls.algorithm:
            raise ConfigError(
                [
                    f'algorithm="{algorithm}" given to {cls.__name__}: '
                    "use rlkit.config.config_from_dict (or config_from_toml)"
                ]
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
        need(p, self.advantage != "gae", 'advantage="gae" needs a critic: use rlkit.PPOConfig')
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
        need(
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
