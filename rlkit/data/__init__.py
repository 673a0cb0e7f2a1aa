"""Data: the batch container, prompt sources, the bundled synthetic task and its reward."""

from rlkit.data.batch import Batch
from rlkit.data.prompts import PromptSource

__all__ = ["Batch", "PromptSource"]
