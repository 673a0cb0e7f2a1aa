"""Diagnostics as plain data (dataclasses and pandas), independent of Jupyter."""

from rlkit.diagnostics.memory import memory_mb

__all__ = ["memory_mb"]
