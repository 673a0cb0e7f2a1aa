"""What runs on every rank: the policy, critic and reward-model roles, and the batches and metrics they share.

The controller (rlkit.trainer) builds each role on all ranks with rlkit.runtime.RoleGroup and calls
its methods by name; every module here runs on the workers, never in the kernel.
"""

from rlkit.workers.batches import CriticRows, PolicyRows
from rlkit.workers.critic import CriticWorker
from rlkit.workers.messages import RolloutResult, SampleResult, UpdateResult, ValuesResult
from rlkit.workers.policy import PolicyWorker
from rlkit.workers.reward_model import RewardModelWorker

__all__ = [
    "CriticRows",
    "CriticWorker",
    "PolicyRows",
    "PolicyWorker",
    "RewardModelWorker",
    "RolloutResult",
    "SampleResult",
    "UpdateResult",
    "ValuesResult",
]
