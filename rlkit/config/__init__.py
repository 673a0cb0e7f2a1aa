"""Run configuration: nested keyword-only dataclasses, validated whole.

Every field carries a docstring (the string under it). A config is checked in
``__post_init__``; every problem is collected and reported at once in one
:class:`ConfigError`, each naming the setting, the value and the fix. Checks
that need the cluster (divisibility by the world size) run in
:meth:`RLConfig.check_cluster` before the trainer loads anything. :class:`GRPOConfig` and
:class:`PPOConfig` share every setting of :class:`RLConfig`; PPO adds the critic. The offline
preference configs :class:`DPOConfig` and :class:`KTOConfig` share the model, optimizer, FSDP and
checkpoint settings.
"""

from rlkit.config.agent import AgentConfig, ToolSpec
from rlkit.config.algorithms import GRPOConfig, PPOConfig
from rlkit.config.checks import ConfigError
from rlkit.config.correction import CORRECTION_PRESETS, RolloutCorrectionConfig
from rlkit.config.data import (
    DataConfig,
    PreferenceDataConfig,
    PreferenceValidationConfig,
    RewardSpec,
    ValidationConfig,
)
from rlkit.config.lora import LoraConfig
from rlkit.config.outputs import default_output_dir, to_toml
from rlkit.config.preference import DPOConfig, KTOConfig, PreferenceConfig
from rlkit.config.primitives import PrimitivesConfig
from rlkit.config.readers import config_from_dict, config_from_toml
from rlkit.config.run import RLConfig
from rlkit.config.sections import (
    ATTN_IMPLEMENTATIONS,
    ENGINES,
    SHARDING,
    CheckpointConfig,
    CriticConfig,
    FSDPConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "AgentConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "CriticConfig",
    "DPOConfig",
    "ENGINES",
    "FSDPConfig",
    "GRPOConfig",
    "KTOConfig",
    "LoraConfig",
    "OptimConfig",
    "PPOConfig",
    "PreferenceConfig",
    "PreferenceDataConfig",
    "PreferenceValidationConfig",
    "PrimitivesConfig",
    "RLConfig",
    "RewardSpec",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "CORRECTION_PRESETS",
    "SHARDING",
    "ToolSpec",
    "ValidationConfig",
    "config_from_dict",
    "config_from_toml",
    "default_output_dir",
    "to_toml",
]
