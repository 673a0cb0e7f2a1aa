"""The settings of a Tinker-style training client (:class:`rlkit.TrainingClient`): the model, its LoRA adapters,
the sharding and the sampler. The optimizer's hyperparameters come with each ``optim_step`` (Tinker's AdamParams)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlkit.config.checks import ConfigError, need
from rlkit.config.lora import LoraConfig
from rlkit.config.sections import FSDPConfig, RolloutConfig
from rlkit.config.tables import convert_tables
from rlkit.config.typed import type_problems


@dataclass(kw_only=True)
class PrimitivesConfig:
    """What a training client holds on every rank: the FSDP actor with LoRA adapters, AdamW, a rollout engine."""

    model: str = "tiny"
    """"tiny" (the bundled model) or a local Hugging Face model directory (nothing is downloaded)."""
    seed: int = 0
    """Seeds the adapters' initialisation and the sampler's default seed."""
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(rank=8, alpha=16.0))
    """The adapters trained (Tinker's clients are LoRA clients: rank > 0 is required)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """How the actor is sharded over the ranks."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(lora_sync="adapter"))
    """The engine ``sample`` runs on; ``rollout.lora_sync`` says what ``save_weights_for_sampler`` sends it."""
    max_prompt_tokens: int = 512
    """The longest prompt ``sample`` accepts (vLLM sizes its context for it)."""
    max_samples: int = 16
    """The most sequences one ``sample`` call asks for (vLLM batches up to it)."""
    micro_batch_size: int = 8
    """Data per forward pass on each rank in ``forward``/``forward_backward`` (gradients add up over the passes):
    the activations held at once. The LM head never holds [data, tokens, vocabulary] logits, whatever the size."""
    trust_remote_code: bool = False
    """Let transformers run the model directory's own code."""

    def __post_init__(self) -> None:
        convert_tables(self)
        problems = type_problems(self) or self.problems()  # the value checks need values of the right types
        if problems:
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        p: list[str] = []
        need(p, self.model == "tiny" or Path(self.model).is_dir(),
             f'model="{self.model}": not "tiny" or a local directory (nothing is downloaded)')  # fmt: skip
        need(p, self.lora.enabled, f"lora.rank={self.lora.rank}: a training client trains LoRA adapters, e.g. 8")
        need(p, self.max_prompt_tokens >= 1, f"max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        need(p, self.max_samples >= 1, f"max_samples={self.max_samples}: must be >= 1")
        need(p, self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size}: must be >= 1, e.g. 8")
        return p + self.lora.problems() + self.fsdp.problems() + self.rollout.problems()
