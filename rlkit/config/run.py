"""The settings every RL algorithm shares (:class:`RLConfig`); GRPO and PPO are in :mod:`rlkit.config.algorithms`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
from rlkit.algos.aggregation import LOSS_AGG_MODES
from rlkit.algos.kl import KL_ESTIMATORS
from rlkit.algos.losses import POLICY_LOSSES
from rlkit.config.agent import TOKEN_ESTIMATORS, AgentConfig, ToolSpec
from rlkit.config.checks import ConfigError, need
from rlkit.config.correction import RolloutCorrectionConfig
from rlkit.config.data import DataConfig, RewardSpec, ValidationConfig, rewards_problems, trackers_problems
from rlkit.config.installed import torch_companion_problems, tracker_install_problems
from rlkit.config.lora import LoraConfig
from rlkit.config.sections import (
    ATTN_IMPLEMENTATIONS,
    CheckpointConfig,
    FSDPConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
    attention_problems,
)
from rlkit.config.tables import config_from_tables, convert_tables
from rlkit.config.typed import type_problems


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
    """"tiny" (the bundled model and task), "tiny-agent" (the bundled multi-turn model and its two-tool task) or a
    local Hugging Face model directory."""
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
    max_tokens_per_micro_batch: int = 0
    """Token-budget micro-batches: each forward/backward (the update's, and the scoring passes': old and reference
    log-probs, the critic's values, the reward model) takes rows of at most this many real tokens (prompt +
    response), as few micro-batches as fit, the same number on every rank, tokens balanced across them; 0 counts
    sequences (micro_batch_size), unless a packed run on GPUs does not fit that way: the memory plan
    (rlkit.diagnostics.plan) then sets the largest budget that fits. Must hold the longest row: >=
    data.max_prompt_tokens + rollout.max_new_tokens."""
    recompute_logprobs: bool = True
    """Score each rollout with the actor before the update (a forward pass over every sample) for the
    PPO ratio's old log-probs, ``batch.logprobs`` and the rollout log-prob gap. With one optimizer step
    per batch (ppo_epochs = mini_batches = 1) the update's own forward yields the same numbers, so
    False skips the pass and ``trainer.update`` fills ``batch.logprobs`` (and the gap) from it. In bypass mode
    (``rollout_correction.bypass``) the engine's log-probs are the old policy, so False is allowed with any
    ppo_epochs and mini_batches (the first epoch's forwards fill ``batch.logprobs``): the pass bypass saves."""
    advantage: str = "grpo"
    """Advantage estimator (rlkit.algos.ADVANTAGE_ESTIMATORS): "grpo", "drgrpo" (no std scaling),
    "rloo", "reinforce++-baseline" (group mean, then batch whitening), "reinforce++" or "gae" (needs a
    critic: PPOConfig). The group estimators group rows by ``Batch.group``. Trainer(advantage_fn=...)
    overrides it."""
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
    policy_loss: str = "ppo_clip"
    """Policy loss (rlkit.algos.POLICY_LOSSES): "ppo_clip" (per-token ratio, PPO); "gspo" (the sequence's
    length-normalised ratio on every token, GSPO-token, Zheng et al. 2025; the paper clips with
    clip_eps=3e-4, clip_high=4e-4 and aggregates with "seq-mean-token-mean"); "cispo" (MiniMax-M1: the ratio,
    clipped to [1 - clip_eps, 1 + clip_high] and detached, weights REINFORCE's gradient, never zeroes it; verl
    loss_mode="cispo"; TRL's loss_type="cispo" with epsilon_high=5 is clip_eps=1, clip_high=4); "sapo" (a soft
    gate instead of the clip, temperatures sapo_tau_pos/neg; verl loss_mode="sapo", TRL loss_type="sapo"; both
    aggregate "seq-mean-token-mean"). Trainer(policy_loss_fn=...) overrides it."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens of positive advantage, > 0 (verl tau_pos; TRL sapo_temperature_pos)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for the others, > 0 (verl tau_neg; TRL sapo_temperature_neg)."""
    log_ratio_clamp: float = 20.0
    """The policy's log-ratio to the old policy (and k3's exponent) is clamped to +-this before exp, its
    gradient 0 beyond (verl: 20), so a ratio never overflows; in (0, 80]."""
    loss_agg: str = "token-mean"
    """How per-token losses are combined: "token-mean" (DAPO; TRL "dapo"), "seq-mean-token-mean" (original
    GRPO; TRL "grpo"), "seq-mean-token-sum" (each sequence's token sum, averaged over sequences, as verl's
    name), "seq-mean-token-sum-norm" (the same divided by max_new_tokens: Dr.GRPO; TRL "dr_grpo"; what
    "seq-mean-token-sum" meant in rlkit before) or "token-sum". See rlkit.algos.aggregation."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss), >= 0."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen reference; 0 skips the reference model."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: "k1", "k2" or "k3" (Schulman 2020); see rlkit.algos.kl_estimate. k3 is the
    default wherever the KL goes (GRPO's loss term and PPO's reward penalty alike): unbiased, never
    negative and of lower variance than k1 near the reference. "k1" reproduces InstructGPT's and
    verl's in-reward penalty."""
    kl_clamp: float | None = 10.0
    """The per-token KL estimate is clamped to [-kl_clamp, kl_clamp], its gradient 0 where clamped (verl caps
    k3 at 10: reached once the reference gives a token ~2.6 nats more than the policy); None = no clamp."""
    kl_mode: str = "loss"
    """Where the KL goes: "loss" (a term of the actor's loss, as in GRPO) or "reward" (a per-token penalty
    subtracted from the rewards before advantages, as in InstructGPT-style PPO)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025): completions longer than max_new_tokens - overlong_buffer
    tokens lose up to ``overlong_penalty`` reward, linearly, by max_new_tokens; 0 = off, else in
    [1, rollout.max_new_tokens]."""
    overlong_penalty: float = 1.0
    """The reward taken from a completion of max_new_tokens tokens by the overlong punishment, >= 0."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens (finish reason "length") out of the loss (DAPO; TRL's
    mask_truncated_completions), and trajectories cut at their token budget ("budget"); their rewards still count
    in their group's advantages."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (zero group-relative advantage,
    no gradient) and sample more prompts until prompts_per_step informative groups are collected, at most
    max_refill_rounds extra rounds. Needs group_size >= 2."""
    max_refill_rounds: int = 4
    """With dynamic_sampling: extra rollout rounds per step, >= 1; when spent, the step trains on the
    informative groups collected so far (the history counts the rounds and the groups kept)."""
    trust_remote_code: bool = False
    """Allow a model directory's own Python code to run (off: nothing runs that rlkit did not ask for)."""
    padding_free: bool = True
    """Pack each micro-batch's sequences into one row (position ids restarting per sequence) so that padding is
    never computed, and run the LM head on response tokens only (actor, reference and critic). Models of
    families rlkit cannot pack (rlkit.models.packing.PACKABLE_MODEL_TYPES, no sliding windows) keep padded rows."""
    attn_implementation: str = "sdpa"
    """Attention kernel: "sdpa" (PyTorch's; packed rows take torch's varlen flash kernel on GPU),
    "flash_attention_2" (needs flash-attn, GPU) or "flex_attention" (GPU; block-sparse document mask)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings; a string is short for ``RolloutConfig(engine=...)``, e.g. ``rollout="vllm"``."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection for the gap between engine and trainer (``[rollout_correction]``; off)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer settings."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding settings (actor, reference, critic and reward model)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the policy instead of full fine-tuning (``[lora]``; off while ``lora.rank`` is 0)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint settings."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """An optional reward model on the workers."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files, the prompt column and chat template, the prompt length limit (``[data]``)."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """How often and how the validation prompts (``data.val_files``) are scored (``[validation]``)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions named by file or module, with weights (``[[rewards]]`` tables in TOML)."""
    tools: list[ToolSpec] = field(default_factory=list)
    """Tool functions named by file or module (``[[tools]]`` tables in TOML); with tools (or an environment) a
    rollout is multi-turn: see :class:`rlkit.config.agent.AgentConfig`. ``Trainer(tools=[fn])`` adds to them."""
    environment: str = ""
    """An environment class named by file or module, ``"file.py:Class"`` (one instance per trajectory:
    ``reset(**fields)``, ``step(text) -> (observation, reward, done)``, either may be async); "" = none.
    ``Trainer(environment=Class)`` replaces it."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The limits of a multi-turn trajectory and how tool calls are parsed (``[agent]``)."""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers that get every metric, the config and sample completions: any of
    "tensorboard", "wandb", "mlflow" (each needs its extra, e.g. ``pip install 'rlkit[tensorboard]'``)."""
    output_dir: str = ""
    """The run's folder: ``history.csv`` (rewritten every step), ``config.toml``, the trackers' files, checkpoints
    (``checkpoints/``), the report and the final model (``final/``) of ``rlkit train``. "": with ``rlkit train``,
    ``outputs/<algorithm>-<model>-<YYYYmmdd-HHMMSS>`` under the working directory; in Python, that folder only when
    trackers or checkpoints need one (else the trainer writes no files)."""

    def __post_init__(self) -> None:
        if isinstance(self.rollout, str):
            self.rollout = RolloutConfig(engine=self.rollout)
        convert_tables(self)
        problems = type_problems(self) or self.problems()  # the value checks need values of the right types
        if problems:
            raise ConfigError(problems)

    @property
    def samples_per_step(self) -> int:
        """Completions per step: prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size

    def problems(self) -> list[str]:
        p: list[str] = []
        need(p, self.model != "", 'model="": give "tiny" or a local Hugging Face model directory')
        if self.model not in ("", "tiny", "tiny-agent") and not Path(self.model).is_dir():
            p.append(f'model="{self.model}": not "tiny", "tiny-agent" or a local directory (nothing is downloaded)')
        need(p, self.steps >= 1, f"steps={self.steps}: must be >= 1")
        need(p, self.prompts_per_step >= 1, f"prompts_per_step={self.prompts_per_step}: must be >= 1")
        need(p, self.ppo_epochs >= 1, f"ppo_epochs={self.ppo_epochs}: must be >= 1")
        need(p, self.mini_batches >= 1, f"mini_batches={self.mini_batches}: must be >= 1")
        need(p, self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size}: must be >= 1")
        longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        need(
            p,
            self.max_tokens_per_micro_batch == 0 or self.max_tokens_per_micro_batch >= longest,
            f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: must hold the longest row, "
            f"data.max_prompt_tokens + rollout.max_new_tokens = {longest} tokens (or 0 to count sequences)",
        )
        p += self._recompute_problems() + self._algorithm_problems()
        cispo = self.policy_loss == "cispo"  # clip_eps = 1 leaves CISPO's weight unbounded below (TRL's CISPO)
        need(
            p,
            0 < self.clip_eps and (self.clip_eps <= 1 if cispo else self.clip_eps < 1),
            f"clip_eps={self.clip_eps}: must be in (0, 1), e.g. 0.2 (in (0, 1] with policy_loss=\"cispo\", where 1 "
            "means no lower clip, as verl's clip_ratio_low=10 and TRL's CISPO: a larger value clips nothing more)",
        )
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
        p += self._loss_problems() + self._shaping_problems() + self._agent_problems()
        need(p, self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef}: must be >= 0 (0 = no bonus)")
        need(p, self.kl_coef >= 0, f"kl_coef={self.kl_coef}: must be >= 0 (0 disables the reference)")
        need(p, self.kl_estimator in KL_ESTIMATORS, f'kl_estimator="{self.kl_estimator}": use one of {KL_ESTIMATORS}')
        need(
            p,
            self.kl_clamp is None or self.kl_clamp > 0,
            f"kl_clamp={self.kl_clamp}: must be > 0 (e.g. 10), or None for no clamp",
        )
        need(p, self.kl_mode in ("loss", "reward"), f'kl_mode="{self.kl_mode}": use "loss" or "reward"')
        need(
            p,
            self.attn_implementation in ATTN_IMPLEMENTATIONS,
            f'attn_implementation="{self.attn_implementation}": use one of {ATTN_IMPLEMENTATIONS}',
        )
        nested = self.rollout.problems() + self.optim.problems() + self.fsdp.problems() + self.checkpoint.problems()
        nested += self.data.problems() + self.validation.problems() + rewards_problems(self.rewards)
        nested += self._correction_problems() + self.lora.problems() + self._lora_problems()
        return p + nested + self.reward_model.problems() + trackers_problems(self.trackers)

    def _recompute_problems(self) -> list[str]:
        """Checks of ``recompute_logprobs=False`` (the update's first forward stands for the old policy)."""
        p: list[str] = []
        if self.recompute_logprobs:
            return p
        need(
            p,
            self.ppo_epochs == 1 and self.mini_batches == 1 or self.rollout_correction.bypass,
            f"recompute_logprobs=False with ppo_epochs={self.ppo_epochs}, mini_batches={self.mini_batches}: "
            "later optimizer steps need the log-probs from before the first; set both to 1, "
            "recompute_logprobs=True, or rollout_correction.bypass=True (the engine's log-probs are the old policy)",
        )
        need(
            p,
            not (self.kl_mode == "reward" and self.kl_coef > 0),
            'recompute_logprobs=False with kl_mode="reward": the KL penalty needs the log-probs before '
            'the advantages; use kl_mode="loss" or recompute_logprobs=True',
        )
        return p

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

    def _loss_problems(self) -> list[str]:
        """Checks of the policy loss, its clamp and the aggregation."""
        p: list[str] = []
        need(
            p,
            self.policy_loss in POLICY_LOSSES,
            f'policy_loss="{self.policy_loss}": use one of {list(POLICY_LOSSES)} (or pass Trainer(policy_loss_fn=...))',
        )
        need(
            p,
            0 < self.log_ratio_clamp <= 80,
            f"log_ratio_clamp={self.log_ratio_clamp}: must be in (0, 80] (exp(88) overflows float32), e.g. 20",
        )
        need(p, self.loss_agg in LOSS_AGG_MODES, f'loss_agg="{self.loss_agg}": use one of {LOSS_AGG_MODES}')
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            need(p, getattr(self, name) > 0, f"{name}={getattr(self, name)}: must be > 0 (SAPO: 1.0 and 1.05)")
        return p

    def _lora_problems(self) -> list[str]:
        """``rollout.lora_sync="adapter"`` sends LoRA matrices alone: adapters must exist and nothing train whole. And
        no adapter dropout: RL scores the same tokens several times (the engine, the old policy, the loss) and
        compares them, so dropout would make an unchanged policy's ratio differ from 1 and the engine gap grow."""
        p: list[str] = []
        critic = getattr(self, "critic", None)  # PPO's
        for lora, prefix in ((self.lora, "lora"), (critic.lora if critic else None, "critic.lora")):
            if lora is None:
                continue
            need(p, not lora.enabled or lora.dropout == 0, f"{prefix}.dropout={lora.dropout}: RL compares the "
                 "engine's, the old policy's and the loss's log-probs of the same tokens, and dropout makes them "
                 "differ (an unchanged policy's ratio is not 1); set it to 0, as verl's and TRL's RL recipes do")
        if self.rollout.lora_sync != "adapter":
            return p
        need(p, self.lora.enabled, 'rollout.lora_sync="adapter" without adapters: set lora.rank > 0 or use "merged"')
        need(
            p,
            not self.lora.modules_to_save,
            f'rollout.lora_sync="adapter" with lora.modules_to_save={self.lora.modules_to_save}: an engine\'s LoRA '
            'adapter holds low-rank matrices only; use rollout.lora_sync="merged"',
        )
        return p

    def _correction_problems(self) -> list[str]:
        """The ``[rollout_correction]`` table's checks, and the engine log-probs it needs on every row."""
        p = self.rollout_correction.problems()
        need(
            p,
            not self.rollout_correction.enabled or self.rollout.engine != "vllm" or self.rollout.engine_logprobs == 1,
            f"rollout_correction is on but rollout.engine_logprobs={self.rollout.engine_logprobs}: the correction "
            "weighs every row by the engine's log-probs; set rollout.engine_logprobs=1",
        )
        return p

    def _shaping_problems(self) -> list[str]:
        """Checks of DAPO's overlong punishment, truncation masking and dynamic sampling."""
        p: list[str] = []
        horizon = self.rollout.max_new_tokens
        need(
            p,
            0 <= self.overlong_buffer <= horizon,
            f"overlong_buffer={self.overlong_buffer}: must be in [0, rollout.max_new_tokens={horizon}] (0 = off)",
        )
        need(p, self.overlong_penalty >= 0, f"overlong_penalty={self.overlong_penalty}: must be >= 0, e.g. 1.0")
        if self.dynamic_sampling:
            need(
                p,
                self.group_size >= 2,
                f"dynamic_sampling=True with group_size={self.group_size}: groups of one sample are never "
                "informative; use group_size >= 2 or dynamic_sampling=False",
            )
            need(p, self.max_refill_rounds >= 1, f"max_refill_rounds={self.max_refill_rounds}: must be >= 1, e.g. 4")
        return p

    def _agent_problems(self) -> list[str]:
        """Checks of ``[[tools]]``, ``environment`` and ``[agent]`` (their files are checked by load_run_data)."""
        p = [q for i, t in enumerate(self.tools) for q in t.problems(f"tools[{i}]")] + self.agent.problems()
        where, _, name = self.environment.rpartition(":")
        need(p, not self.environment or (where.strip() != "" and name.strip() != ""),
             f'environment="{self.environment}": write "my_env.py:GuessNumber" or "package.module:GuessNumber"')
        per_token = not self.agent.turn_rewards or self.advantage in TOKEN_ESTIMATORS
        need(p, per_token, f'agent.turn_rewards = true with advantage="{self.advantage}": a group estimator sees each '
             "trajectory's summed reward, so the rewards per turn would change nothing; use advantage in "
             f"{TOKEN_ESTIMATORS}, or leave turn_rewards off")  # fmt: skip
        budget = self.rollout.max_new_tokens
        need(p, self.agent.max_turn_tokens <= budget, f"agent.max_turn_tokens={self.agent.max_turn_tokens}: must be "
             f"at most the trajectory's budget, rollout.max_new_tokens={budget}")  # fmt: skip
        return p

    def check_cluster(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        nodes: Sequence[object] | None = None,
        node_gpus: int | None = None,
    ) -> None:
        """Raise ConfigError with every :meth:`cluster_problems`. The model's family is checked beside it, before
        launch, by :func:`rlkit.diagnostics.check_launch` (it builds the model on the meta device)."""
        problems = self.cluster_problems(world_size, device, nodes=nodes, node_gpus=node_gpus)
        if problems:
            raise ConfigError(problems)

    def cluster_problems(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        nodes: Sequence[object] | None = None,
        node_gpus: int | None = None,
    ) -> list[str]:
        """Whether the batch divides across ``world_size`` ranks, FSDP and rollout settings fit the ranks (``nodes``:
        each rank's node, where known; ``node_gpus``: the GPUs of a node, on GPU machines), the attention runs on
        ``device`` and the trackers are installed: one message per problem."""
        p: list[str] = self.fsdp.cluster_problems(world_size, device)
        p += self.rollout.cluster_problems(world_size, nodes, node_gpus)
        p += attention_problems(self.attn_implementation, device)
        p += tracker_install_problems(self.trackers) + torch_companion_problems()
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
        return p

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
        return config_from_tables(cls, data)
