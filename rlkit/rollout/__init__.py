"""Rollout engines (HF generate, vLLM): generation with per-token log-probs, and loading the actor's weights."""

from rlkit.rollout.base import Generation, RolloutEngine, SamplingParams
from rlkit.rollout.build import build_engine
from rlkit.rollout.hf import HFEngine

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SamplingParams", "build_engine"]
