"""The controller: phase orchestration (Trainer, PreferenceTrainer), the step's metrics row, checkpoints on disk.

Nothing here runs on the workers: the rank-side roles are in rlkit.workers.
"""

from rlkit.trainer.preference import PreferenceTrainer
from rlkit.trainer.primitives import TrainingClient
from rlkit.trainer.trainer import Trainer

__all__ = ["PreferenceTrainer", "Trainer", "TrainingClient"]
