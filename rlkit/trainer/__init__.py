"""Phase orchestration on the controller (Trainer) and the per-rank work it drives (policy_worker)."""

from rlkit.trainer.trainer import Trainer

__all__ = ["Trainer"]
