"""Offline preference training configs: :class:`DPOConfig` (DPO, IPO, reference-free DPO) and :class:`KTOConfig`.

They share the model, optimizer, FSDP and checkpoint settings of the RL configs and are validated the
same way: every problem at once, in one :class:`ConfigError`, each naming the setting and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlkit.algos.preference import DPO_LOSSES
from rlkit.config.checks import ConfigError, need
from rlkit.config.data import PreferenceDataConfig, PreferenceValidationConfig, trackers_problems
from rlkit.config.installed import torch_companion_problems, tracker_install_problems
from rlkit.config.sections import CheckpointConfig, FSDPConfig, OptimConfig
from rlkit.config.tables import config_from_tables, convert_tables
from rlkit.config.typed import type_problems


@dataclass(kw_only=True)
class PreferenceConfig:
    """Settings DPO and KTO share; make a :class:`DPOConfig` or a :class:`KTOConfig`.

    Each step takes ``batch_size`` examples, scores their completions under the policy and the frozen
    reference (summed log-probs of the completion tokens given the prompt) and takes one optimizer step.
    """

    algorithm: ClassVar[str] = ""
    model: str = "tiny"
    """"tiny" (the bundled model) or a local Hugging Face model directory; the reference is a frozen copy."""
    seed: int = 0
    """Seed for shuffling and initialisation; same seed, same run."""
    steps: int = 50
    """Steps (optimizer steps) that ``fit()`` runs by default, >= 1."""
    batch_size: int = 16
    """Examples per optimizer step over all ranks (pairs for DPO); must divide across ranks."""
    micro_batch_size: int = 8
    """Examples per forward/backward on a rank (gradient accumulation above it)."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference (the reward is beta * log(pi / pi_ref)), > 0."""
    trust_remote_code: bool = False
    """Allow a model directory's own Python code to run (off: nothing runs that rlkit did not ask for)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """The policy's optimizer (preference tuning takes small steps: TRL's default lr is 1e-6)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding settings (policy and reference)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint settings."""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers that get every metric, the config and each step's examples with their rewards: any of
    "tensorboard", "wandb", "mlflow" (each needs its extra, e.g. ``pip install 'rlkit[tensorboard]'``)."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """The example files, held-out examples and length limits (``[data]``, as in an RL run)."""
    validation: PreferenceValidationConfig = field(default_factory=PreferenceValidationConfig)
    """When the held-out examples (``data.val_files``) are scored (``[validation]``)."""
    output_dir: str = ""
    """The run's folder (``history.csv``, ``config.toml``, trackers, ``checkpoints/``, the report, ``final/``);
    "": as for :attr:`rlkit.config.RLConfig.output_dir`."""

    def __post_init__(self) -> None:
        convert_tables(self)
        problems = type_problems(self) or self.problems()  # the value checks need values of the right types
        if problems:
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        p: list[str] = []
        need(p, self.model != "", 'model="": give "tiny" or a local Hugging Face model directory')
        if self.model not in ("", "tiny") and not Path(self.model).is_dir():
            p.append(f'model="{self.model}": not "tiny" and not a local directory (nothing is downloaded)')
        need(p, self.steps >= 1, f"steps={self.steps}: must be >= 1")
        need(p, self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1")
        need(p, self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size}: must be >= 1")
        need(p, self.beta > 0, f"beta={self.beta}: must be > 0, e.g. 0.1")
        p += self._algorithm_problems() + trackers_problems(self.trackers) + self.data.problems()
        p += self.validation.problems()
        return p + self.optim.problems() + self.fsdp.problems() + self.checkpoint.problems()

    def _algorithm_problems(self) -> list[str]:
        return []

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a frozen reference (the workers then load one)."""
        return True

    @property
    def sequences_per_example(self) -> int:
        """Completions scored per example: 2 for a DPO pair (chosen, rejected), 1 for a KTO example."""
        return 1

    def check_cluster(self, world_size: int, device: str = "cpu") -> None:
        """Raise ConfigError with every :meth:`cluster_problems` (the model's family is checked beside it, before
        launch, by :func:`rlkit.diagnostics.check_launch`)."""
        problems = self.cluster_problems(world_size, device)
        if problems:
            raise ConfigError(problems)

    def cluster_problems(self, world_size: int, device: str = "cpu") -> list[str]:
        """Whether the batch divides across ``world_size`` ranks, FSDP settings fit and the trackers are installed:
        one message per problem."""
        p = self.fsdp.cluster_problems(world_size, device)
        p += tracker_install_problems(self.trackers) + torch_companion_problems()
        need(
            p,
            self.batch_size % world_size == 0,
            f"batch_size={self.batch_size} does not divide across {world_size} ranks: use a multiple of {world_size}",
        )
        return p + self._cluster_problems(world_size)

    def _cluster_problems(self, world_size: int) -> list[str]:
        return []

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-able), with ``algorithm`` naming the class."""
        return {"algorithm": self.algorithm, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreferenceConfig:
        data = dict(data)
        algorithm = data.pop("algorithm", cls.algorithm)
        if algorithm != cls.algorithm:
            raise ConfigError([f'algorithm="{algorithm}" given to {cls.__name__}: use the config of that algorithm'])
        return config_from_tables(cls, data)


@dataclass(kw_only=True)
class DPOConfig(PreferenceConfig):
    """Direct Preference Optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023) and its relatives.

    loss="sigmoid" is DPO (with label_smoothing, conservative DPO); loss="ipo" is IPO (Azar et al. 2023);
    reference_free=True drops the reference (plain reference-free DPO, not SimPO). See rlkit.algos.dpo_loss.
    """

    algorithm: ClassVar[str] = "dpo"
    loss: str = "sigmoid"
    """"sigmoid" (DPO: -log sigmoid(beta h)) or "ipo" ((h - 1 / (2 beta))^2), h the margin of log-ratios."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference label is wrong (conservative DPO), in [0, 0.5); "sigmoid" only."""
    reference_free: bool = False
    """Compare the policy's log-probs alone (the reference taken as uniform): no reference model is loaded."""

    def _algorithm_problems(self) -> list[str]:
        p: list[str] = []
        need(p, self.loss in DPO_LOSSES, f'loss="{self.loss}": use one of {DPO_LOSSES}')
        need(
            p,
            0 <= self.label_smoothing < 0.5,
            f"label_smoothing={self.label_smoothing}: must be in [0, 0.5) (0 = plain DPO)",
        )
        need(
            p,
            not (self.loss == "ipo" and self.label_smoothing),
            f'label_smoothing={self.label_smoothing} with loss="ipo": label smoothing is for "sigmoid"; set it to 0',
        )
        return p

    @property
    def needs_reference(self) -> bool:
        return not self.reference_free

    @property
    def sequences_per_example(self) -> int:
        return 2


@dataclass(kw_only=True)
class KTOConfig(PreferenceConfig):
    """Kahneman-Tversky Optimisation on (prompt, completion, label) examples (Ethayarajh et al. 2024).

    Each step's KL baseline z_ref comes from mismatched pairs: prompt i with completion i - 1 of the
    batch (as TRL), averaged over all ranks. See rlkit.algos.kto_loss.
    """

    algorithm: ClassVar[str] = "kto"
    desirable_weight: float = 1.0
    """lambda_D, the weight of desirable examples' losses, > 0."""
    undesirable_weight: float = 1.0
    """lambda_U, the weight of undesirable examples' losses, > 0; the paper keeps
    lambda_D * n_desirable / (lambda_U * n_undesirable) in [1, 4/3]."""

    def _algorithm_problems(self) -> list[str]:
        p: list[str] = []
        need(p, self.desirable_weight > 0, f"desirable_weight={self.desirable_weight}: must be > 0, e.g. 1.0")
        need(p, self.undesirable_weight > 0, f"undesirable_weight={self.undesirable_weight}: must be > 0, e.g. 1.0")
        return p

    def _cluster_problems(self, world_size: int) -> list[str]:
        p: list[str] = []
        need(
            p,
            self.batch_size >= 2 * world_size,
            f"batch_size={self.batch_size} on {world_size} ranks: KTO's mismatched pairs need >= 2 examples "
            f"per rank; use batch_size >= {2 * world_size}",
        )
        return p
