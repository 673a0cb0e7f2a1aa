"""Rollout engines (generation with per-token log-probs) and weight sync from the FSDP actor."""

from rlkit.rollout.base import Generation, RolloutEngine, SamplingParams
from rlkit.rollout.hf import HFEngine
from rlkit.rollout.sync import gathered_weights

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SamplingParams", "gathered_weights"]
