"""The ``[rollout_correction]`` table: correcting the policy loss for the gap between rollout engine and trainer.

The math is :mod:`rlkit.algos.correction`; each setting names its counterparts in verl
(``algorithm.rollout_correction``) and TRL (``GRPOConfig``), so a recipe from either carries over.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.algos.correction import CORRECTION_LEVELS
from rlkit.config.checks import need

CORRECTION_PRESETS = ("verl_token_is", "verl_sequence_is", "verl_bypass", "trl_token_truncate",
                      "trl_sequence_truncate", "trl_token_mask", "trl_sequence_mask", "openrlhf_tis", "icepop",
                      "seq_mask_tis", "slime_tis")  # fmt: skip
"""The peers' recipes :meth:`RolloutCorrectionConfig.preset` knows."""


def _preset_settings(name: str) -> dict[str, object]:
    """The settings of preset ``name`` (the peers' defaults, design/MISMATCH.md section 1)."""
    none = {"weight_cap": None}
    match name:
        case "verl_token_is":  # rollout_is="token", rollout_is_threshold=2.0
            return {"weight": "token", "weight_cap": 2.0}
        case "verl_sequence_is":  # rollout_is="sequence", the product, threshold 2.0
            return {"weight": "sequence", "weight_cap": 2.0}
        case "verl_bypass":  # bypass_mode=True: the engine is the old policy, no weight
            return {"bypass": True}
        case "trl_token_truncate" | "trl_sequence_truncate":  # vllm_importance_sampling_clip_max=3.0, _clip_min=None
            return {"weight": name.split("_")[1], "weight_cap": 3.0}
        case "trl_token_mask" | "trl_sequence_mask":  # the raw ratio where it is <= clip_max=3.0, else 0
            level = name.split("_")[1]
            return {"weight": level, **none, "mask": level, "mask_low": 0.0, "mask_high": 3.0}
        case "openrlhf_tis":  # --algo.advantage.is_correction_type tis, bounds 0.5 5.0: clip(rho, 0.5, 5)
            return {"weight": "token", "weight_cap": 5.0, "weight_floor": 0.5}
        case "icepop":  # OpenRLHF icepop (NeMo-RL alike): the raw ratio inside [0.5, 5], else 0
            return {"weight": "token", **none, "mask": "token", "mask_low": 0.5, "mask_high": 5.0}
        case "seq_mask_tis":  # OpenRLHF / NeMo-RL: keep a sequence whose geometric mean is in [0.5, 5], raw ratios
            return {"weight": "token", **none, "mask": "geometric", "mask_low": 0.5, "mask_high": 5.0}
        case "slime_tis":  # --use-tis --tis-clip 2 --tis-clip-low 0
            return {"weight": "token", "weight_cap": 2.0}
    raise ValueError(f'rollout_correction preset "{name}": use one of {CORRECTION_PRESETS}')


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection for the training-inference mismatch; off by default (``weight`` and ``mask``
    "none", ``bypass`` False). On, the rollout engine returns log-probs for every row (vLLM: set
    ``rollout.engine_logprobs = 1``) and the weights multiply the policy loss (decoupled PPO: the engine is the
    behaviour policy, the trainer's pre-update log-probs the proximal one).

    The peers' recipes are named presets, each equal to the peer's behaviour at its defaults:
    ``RolloutCorrectionConfig.preset("trl_sequence_mask")`` (see :data:`CORRECTION_PRESETS` and :meth:`preset`).
    """

    weight: str = "none"
    """Truncated importance-sampling weight rho = trainer / engine probability: "none"; "token" (TIS: each token's
    own ratio; verl ``rollout_is="token"``, TRL "token_truncate", OpenRLHF ``tis``, slime ``--use-tis``); "sequence"
    (the product of the sequence's token ratios on each of its tokens, the unbiased sequence ratio; verl
    ``rollout_is="sequence"``, TRL "sequence_truncate"); "geometric" (their geometric mean, length-invariant: GSPO's
    object, a filter rather than an unbiased weight)."""
    weight_cap: float | None = 2.0
    """The weight's upper truncation C, >= 1 (verl ``rollout_is_threshold``, default 2; TRL
    ``vllm_importance_sampling_clip_max``, default 3 (``vllm_importance_sampling_cap`` before TRL #4732); slime
    ``--tis-clip`` 2; OpenRLHF 5); None: no truncation."""
    weight_floor: float = 0.0
    """The weight's lower truncation, in [0, weight_cap) (slime ``--tis-clip-low``; TRL
    ``vllm_importance_sampling_clip_min``, default None; 0: none, as verl and TRL by default)."""
    mask: str = "none"
    """Rejection (MIS / ICEPOP): tokens ("token") or whole sequences ("sequence": the product ratio; "geometric":
    the geometric mean) whose ratio leaves [mask_low, mask_high] get weight 0 (verl ``rollout_rs`` "token_k1",
    "seq_sum_k1", "seq_mean_k1", which replaced "token", "sequence", "geometric" in verl #4511; TRL ``"*_mask"``;
    OpenRLHF ``icepop`` and ``seq-mask-tis``). The loss's token and sequence
    counts keep them (TRL's, OpenRLHF's and NeMo-RL's convention; verl's drops them from the counts)."""
    mask_low: float = 0.5
    """Lower edge of the kept band, in [0, 1] (verl: the "lo" of ``rollout_rs_threshold="lo_hi"``, which replaced
    ``rollout_rs_threshold_lower`` in verl #4511; verl's ``*_k1`` tests -ln rho, so an asymmetric band acts on
    1 / rho there; TRL: 0)."""
    mask_high: float = 2.0
    """Upper edge of the kept band, >= 1 (verl: the "hi" of ``rollout_rs_threshold``; TRL
    ``vllm_importance_sampling_clip_max``)."""
    bypass: bool = False
    """verl's ``bypass_mode``: the engine's log-probs are the old policy's in the loss's ratio (no separate trainer
    scoring enters the loss) and no weight is added (it would count the gap twice); a mask still applies. What it
    saves is the old-log-prob forward: with ``recompute_logprobs=False`` (any ppo_epochs and mini_batches) the
    mask and the mismatch metrics take the current policy at each micro-batch against the engine, as verl's bypass
    rejection does; with ``recompute_logprobs=True`` they take the trainer's pre-update log-probs."""

    @classmethod
    def preset(cls, name: str, **overrides: object) -> RolloutCorrectionConfig:
        """A peer's recipe at its defaults (one of :data:`CORRECTION_PRESETS`), with ``overrides`` on top: e.g.
        ``preset("trl_sequence_mask", mask_high=2.0)`` is TRL's ``vllm_importance_sampling_clip_max=2.0``.

        Example:
            >>> RolloutCorrectionConfig.preset("icepop").summary()
            'weight=token [0, inf], mask=token [0.5, 5]'
        """
        return cls(**{**_preset_settings(name), **overrides})  # type: ignore[arg-type]

    def summary(self) -> str:
        """One phrase: "off", or what the correction does (e.g. "weight=token [0, 2], mask=token [0.5, 2]")."""
        if not self.enabled:
            return "off"
        cap = "inf" if self.weight_cap is None else f"{self.weight_cap:g}"
        parts = ["bypass"] if self.bypass else []
        parts += [f"weight={self.weight} [{self.weight_floor:g}, {cap}]"] if self.weight != "none" else []
        parts += [f"mask={self.mask} [{self.mask_low:g}, {self.mask_high:g}]"] if self.mask != "none" else []
        return ", ".join(parts)

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
