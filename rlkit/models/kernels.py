"""Liger Kernel's fused Triton kernels in a Hugging Face decoder, swapped in place before FSDP wraps it.

``FSDPConfig.kernels="liger"`` replaces each decoder layer's RMSNorm, SwiGLU MLP and rotary embedding with
Liger's kernels (``pip install 'rlkit[kernels]'``, GPU only): the elementwise passes between the matmuls,
fused. rlkit's own fused log-prob head stays (Liger's fused linear cross-entropy returns a loss, not per-token
log-probs). Parameter names and dtypes do not change, so checkpoints, weight syncs and LoRA are unaffected.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

LIGER_FAMILIES = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
}
"""The ``model_type`` values rlkit swaps Liger's kernels into, and Liger's function for each."""


def liger_family_problem(model_type: str) -> str | None:
    """Why ``fsdp.kernels="liger"`` cannot apply to a model of ``model_type`` (None when it can)."""
    if model_type in LIGER_FAMILIES:
        return None
    return (
        f'fsdp.kernels="liger" with a {model_type} model: rlkit swaps Liger\'s kernels into '
        f'{sorted(LIGER_FAMILIES)} only; use fsdp.kernels="torch"'
    )


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Swap ``model``'s RMSNorm, SwiGLU MLP and rotary embedding for Liger's (``kernels="liger"``); "torch" keeps
    them. ``model`` is a transformers model, or a peft model around one (the LoRA layers stay in the MLP)."""
    if kernels == "torch":
        return
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    model_type: str = base.config.model_type
    problem = liger_family_problem(model_type)
    if problem is not None:
        raise ValueError(problem)
    liger = importlib.import_module("liger_kernel.transformers")
    # rlkit's head computes the log-probs: Liger's loss heads stay off, the model's forward is not replaced
    getattr(liger, LIGER_FAMILIES[model_type])(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=base
    )
    logger.info("Liger kernels: RMSNorm, SwiGLU and rotary embedding swapped into %s", type(base).__name__)
