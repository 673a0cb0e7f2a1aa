"""The RL algorithms' configs: GRPO and its critic-free relatives, and PPO with a critic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlkit.config.checks import need
from rlkit.config.run import RLConfig
from rlkit.config.sections import CriticConfig


@dataclass(kw_only=True)
class GRPOConfig(RLConfig):
    """Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath) and its critic-free relatives.

    A completion's advantage is its reward against the other completions of
    its prompt: "grpo" (mean and std), "drgrpo" (mean only), "rloo"
    (leave-one-out); or "reinforce++" (batch-whitened returns). No critic.

    Example:
        >>> import rlkit
        >>> config = rlkit.GRPOConfig(model="tiny", group_size=4, rollout=rlkit.RolloutConfig(max_new_tokens=32))
        >>> config.samples_per_step  # prompts_per_step x group_size
        64
        >>> try:                     # every problem at once, each naming the setting and the fix
        ...     rlkit.GRPOConfig(group_size=1, kl_coef=-1.0)
        ... except rlkit.ConfigError as error:
        ...     for problem in error.problems:
        ...         print(problem)
        group_size=1: must be >= 2 with advantage="grpo" (advantages compare samples in a group)
        kl_coef=-1.0: must be >= 0 (0 disables the reference)
    """

    algorithm: ClassVar[str] = "grpo"

    def _algorithm_problems(self) -> list[str]:
        p = super()._algorithm_problems()
        need(p, self.advantage != "gae", 'advantage="gae" needs a critic: use rlkit.PPOConfig')
        return p


@dataclass(kw_only=True)
class PPOConfig(RLConfig):
    """PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022 for LLMs): GAE advantages from a learned value.

    The critic predicts each token's expected return; GAE combines rewards and
    values into advantages (whitened over the batch) and returns (the critic's
    targets). One sample per prompt is the usual setting.
    """

    algorithm: ClassVar[str] = "ppo"
    prompts_per_step: int = 64
    """Distinct prompts per step; must divide across ranks."""
    group_size: int = 1
    """Completions sampled per prompt (PPO needs no groups)."""
    advantage: str = "gae"
    """Advantage estimator: "gae" (the critic is trained for it), or Trainer(advantage_fn=...) which gets the values."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]: 1 gives Monte-Carlo returns minus V, 0 one-step TD."""
    kl_mode: str = "reward"
    """Where the KL goes: "reward" (per-token penalty before GAE, InstructGPT-style) or "loss"."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""

    def _algorithm_problems(self) -> list[str]:
        p = super()._algorithm_problems()
        need(
            p,
            self.advantage == "gae",
            f'advantage="{self.advantage}": PPOConfig trains a critic for "gae"; '
            "use rlkit.GRPOConfig for critic-free estimators",
        )
        return p + self.critic.problems()
