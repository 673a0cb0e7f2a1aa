"""The ``[rollout_correction]`` table: correcting the policy loss for the gap between rollout engine and trainer.

The math is :mod:`rlkit.algos.correction`; each setting names its counterparts in verl
(``algorithm.rollout_correction``) and TRL (``GRPOConfig``), so a recipe from either carries over.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.algos.correction import CORRECTION_LEVELS
from rlkit.config.checks import need


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection for the training-inference mismatch; off by default (``weight`` and ``mask``
    "none", ``bypass`` False). On, the rollout engine returns log-probs for every row (vLLM: set
    ``rollout.engine_logprobs = 1``) and the weights multiply the policy loss (decoupled PPO: the engine is the
    behaviour policy, the trainer's pre-update log-probs the proximal one).

    Recipes (peer -> rlkit): verl ``rollout_is="token"``, ``rollout_is_threshold=2.0`` -> weight="token",
    weight_cap=2; TRL ``vllm_importance_sampling_mode="token_truncate"`` with cap 3 -> weight="token", weight_cap=3;
    TRL "sequence_truncate" -> weight="sequence"; TRL "token_mask" / "sequence_mask" (its default) -> weight at that
    level, mask at that level, mask_low=0, mask_high=cap; ICEPOP (OpenRLHF ``icepop``, NeMo-RL) -> weight="token",
    mask="token", band [0.5, 5]; OpenRLHF/NeMo-RL ``seq-mask-tis`` -> weight="token", mask="geometric"; verl
    ``rollout_rs="geometric"`` -> mask="geometric"; verl ``bypass_mode=True`` -> bypass=True.
    """

    weight: str = "none"
    """Truncated importance-sampling weight rho = trainer / engine probability: "none"; "token" (TIS: each token's
    own ratio; verl ``rollout_is="token"``, TRL "token_truncate", OpenRLHF ``tis``, slime ``--use-tis``); "sequence"
    (the product of the sequence's token ratios on each of its tokens, the unbiased sequence ratio; verl
    ``rollout_is="sequence"``, TRL "sequence_truncate"); "geometric" (their geometric mean, length-invariant: GSPO's
    object, a filter rather than an unbiased weight)."""
    weight_cap: float | None = 2.0
    """The weight's upper truncation C, >= 1 (verl ``rollout_is_threshold``, default 2; TRL
    ``vllm_importance_sampling_cap``, default 3; slime ``--tis-clip`` 2; OpenRLHF 5); None: no truncation."""
    weight_floor: float = 0.0
    """The weight's lower truncation, in [0, weight_cap) (slime ``--tis-clip-low``; 0: none, as verl and TRL)."""
    mask: str = "none"
    """Rejection (MIS / ICEPOP): tokens ("token") or whole sequences ("sequence": the product ratio; "geometric":
    the geometric mean) whose ratio leaves [mask_low, mask_high] get weight 0 (verl ``rollout_rs`` "token",
    "sequence", "geometric"; TRL "*_mask"; OpenRLHF ``icepop`` and ``seq-mask-tis``). The loss's token and sequence
    counts keep them (TRL's, OpenRLHF's and NeMo-RL's convention; verl's drops them from the counts)."""
    mask_low: float = 0.5
    """Lower edge of the kept band, in [0, 1] (verl ``rollout_rs_threshold_lower``, default 1 / upper; TRL: 0)."""
    mask_high: float = 2.0
    """Upper edge of the kept band, >= 1 (verl ``rollout_rs_threshold``; TRL ``vllm_importance_sampling_cap``)."""
    bypass: bool = False
    """verl's ``bypass_mode``: the engine's log-probs are the old policy's in the loss's ratio (no separate trainer
    scoring enters the loss) and no weight is added (it would count the gap twice); a mask still applies."""

    @property
    def enabled(self) -> bool:
        """Whether the correction changes the loss."""
        return self.weight != "none" or self.mask != "none" or self.bypass

    def problems(self, prefix: str = "rollout_correction") -> list[str]:
        p: list[str] = []
        need(p, self.weight in CORRECTION_LEVELS, f'{prefix}.weight="{self.weight}": use one of {CORRECTION_LEVELS}')
        need(p, self.mask in CORRECTION_LEVELS, f'{prefix}.mask="{self.mask}": use one of {CORRECTION_LEVELS}')
        cap = self.weight_cap
        need(p, cap is None or cap >= 1, f"{prefix}.weight_cap={cap}: must be >= 1 (e.g. 2.0; below 1 it lowers the "
             "weight of every token the engine and trainer agree on), or None for no cap")  # fmt: skip
        need(
            p,
            0 <= self.weight_floor and (cap is None or self.weight_floor < cap),
            f"{prefix}.weight_floor={self.weight_floor}: must be in [0, weight_cap={cap}) (0 = no floor)",
        )
        need(
            p,
            0 <= self.mask_low <= 1 <= self.mask_high,
            f"{prefix}.mask_low={self.mask_low}, mask_high={self.mask_high}: the kept band must contain 1 "
            "(0 <= mask_low <= 1 <= mask_high), e.g. 0.5 and 2.0",
        )
        need(
            p,
            not (self.bypass and self.weight != "none"),
            f'{prefix}.bypass=True with weight="{self.weight}": bypass takes the engine as the old policy, so a weight '
            'would count the gap twice; set weight="none" or bypass=False',
        )
        return p
