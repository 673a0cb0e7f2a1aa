"""Data: the batch container, prompt sources from files or Python, rewards (by name, verifiable), validation math."""

from rlkit.data.batch import Batch
from rlkit.data.evaluation import pass_at_k, validation_metrics
from rlkit.data.loading import PromptReport, load_prompt_source
from rlkit.data.named_rewards import load_rewards
from rlkit.data.prompts import PromptSource
from rlkit.data.run_data import RunData, load_run_data

__all__ = [
    "Batch",
    "PromptReport",
    "PromptSource",
    "RunData",
    "load_prompt_source",
    "load_rewards",
    "load_run_data",
    "pass_at_k",
    "validation_metrics",
]
