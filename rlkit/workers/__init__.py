"""What runs on every rank: the policy, preference, critic and reward-model roles, their batches and metrics.

The controller (rlkit.trainer) builds each role on all ranks with rlkit.runtime.RoleGroup and calls
its methods by name; every module here runs on the workers, never in the kernel.
"""

from rlkit.workers.batches import CriticRows, PolicyRows, PreferenceRows
from rlkit.workers.critic import CriticWorker
from rlkit.workers.messages import (
    PreferenceResult,
    PreferenceScores,
    RolloutResult,
    SampleResult,
    UpdateResult,
    ValuesResult,
)
from rlkit.workers.policy import PolicyWorker
from rlkit.workers.preference import PreferenceWorker
from rlkit.workers.reward_model import RewardModelWorker

__all__ = [
    "CriticRows",
    "CriticWorker",
    "PolicyRows",
    "PolicyWorker",
    "PreferenceResult",
    "PreferenceRows",
    "PreferenceScores",
    "PreferenceWorker",
    "RewardModelWorker",
    "RolloutResult",
    "SampleResult",
    "UpdateResult",
    "ValuesResult",
]
