"""rlkit: notebook-first RL post-training of language models on PyTorch FSDP.

Example::

    cluster = rlkit.launch(world_size=2)
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(model="tiny"))
    trainer.fit(steps=20)
"""

from rlkit.config import (
    AgentConfig,
    CheckpointConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    DPOConfig,
    FSDPConfig,
    GRPOConfig,
    KTOConfig,
    LoraConfig,
    OptimConfig,
    PPOConfig,
    PrimitivesConfig,
    RewardModelConfig,
    RewardSpec,
    RolloutConfig,
    RolloutCorrectionConfig,
    ValidationConfig,
)
from rlkit.data.datum import Datum
from rlkit.runtime import launch
from rlkit.serving import serve_tinker
from rlkit.trainer import PreferenceTrainer, Trainer, TrainingClient
from rlkit.workers.primitives import AdamStep

__version__ = "0.1.0"

__all__ = [
    "AdamStep",
    "AgentConfig",
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "Datum",
    "FSDPConfig",
    "GRPOConfig",
    "KTOConfig",
    "LoraConfig",
    "OptimConfig",
    "PPOConfig",
    "PreferenceTrainer",
    "PrimitivesConfig",
    "RewardModelConfig",
    "RewardSpec",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "Trainer",
    "TrainingClient",
    "ValidationConfig",
    "launch",
    "serve_tinker",
]
