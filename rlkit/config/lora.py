"""``[lora]``: low-rank adapters on the policy (or the critic's backbone) instead of full fine-tuning."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from rlkit.config.checks import need


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA (Hu et al. 2021) with peft (``pip install 'rlkit[lora]'``): the base weights stay frozen and only the
    adapters (and ``modules_to_save``) train, are in the optimizer, the gradient report and the checkpoints. The
    KL reference is the same model with its adapters switched off (no second copy). Off while ``rank`` is 0."""

    rank: int = 0
    """The adapters' rank r (0: no LoRA, full fine-tuning); 8-64 is usual for RL."""
    alpha: float = 32.0
    """The adapters' scale is alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1); keep 0 for RL: with dropout the trainer's
    log-probs are no longer the engine's, and the PPO ratio of an unchanged policy is not 1."""
    target_modules: list[str] | str = "all-linear"
    """The linear layers that get adapters: "all-linear" (every linear layer but the output head), or module names
    matched as the last parts of a module's path (e.g. ["q_proj", "v_proj"]). Every decoder layer must get the
    same ones: a list that matches nothing, or only some layers, is an error before anything loads."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained whole beside the adapters (a trained copy; the reference keeps the original), e.g.
    ["lm_head"] for a model whose output head is not tied to its embedding."""
    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def problems(self, prefix: str = "lora") -> list[str]:
        p: list[str] = []
        need(p, self.rank >= 0, f"{prefix}.rank={self.rank}: must be >= 0 (0 = full fine-tuning), e.g. 16")
        if not self.enabled:
            set_ = [name for name in ("alpha", "dropout", "target_modules", "modules_to_save")
                    if getattr(self, name) != getattr(LoraConfig(), name)]  # fmt: skip
            need(p, not set_, f"{prefix}: {', '.join(set_)} set but {prefix}.rank is {self.rank}, which means no "
                              f"LoRA (full fine-tuning): set {prefix}.rank (e.g. 16), or remove the [{prefix}] table")
            return p
        need(p, self.alpha > 0, f"{prefix}.alpha={self.alpha}: must be > 0, e.g. 2 * rank")
        need(p, 0 <= self.dropout < 1, f"{prefix}.dropout={self.dropout}: must be in [0, 1), 0 recommended for RL")
        targets = self.target_modules
        need(
            p,
            targets == "all-linear" or (isinstance(targets, list) and len(targets) > 0),
            f'{prefix}.target_modules={targets!r}: use "all-linear" or module names, e.g. ["q_proj", "v_proj"]',
        )
        need(
            p,
            importlib.util.find_spec("peft") is not None,
            f"{prefix}.rank={self.rank} but peft is not installed: pip install 'rlkit[lora]', or set rank=0",
        )
        return p
