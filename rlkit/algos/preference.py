"""Offline preference losses on sequence log-probs: DPO (sigmoid), IPO, reference-free DPO, and KTO.

Every input is a [B] tensor of *summed* token log-probs of a completion given its prompt, under the
policy (with gradient) or the frozen reference. The implicit reward of a completion is
``beta * (log pi(y|x) - log pi_ref(y|x))``; the metrics report it detached.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlkit.algos.metrics import Mean

DPO_LOSSES = ("sigmoid", "ipo")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses, with h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)).

    - "sigmoid": DPO (Rafailov et al. 2023), -log sigmoid(beta h); with label_smoothing e > 0 the
      conservative form -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h) (cDPO, Mitchell 2023:
      each label is wrong with probability e).
    - "ipo": IPO (Azar et al. 2023), (h - 1 / (2 beta))^2, on the summed log-ratios as the paper's h
      (TRL averages IPO's log-probs over tokens instead).
    - reference_free: the plain reference-free DPO (the reference log-probs are taken as 0, TRL's
      ``reference_free=True``), not SimPO (no length normalisation, no target margin).

    Args:
        chosen_logps, rejected_logps: [B] policy log-probs of the preferred and the dispreferred completion.
        ref_chosen_logps, ref_rejected_logps: [B] the same under the reference; None with reference_free.
        beta: the KL strength (e.g. 0.1); loss: one of DPO_LOSSES; label_smoothing: in [0, 0.5), "sigmoid" only.
    Returns:
        losses [B] (with gradient), chosen_rewards [B] and rejected_rewards [B] (beta * log-ratio, detached).
    """
    if reference_free:
        ref_chosen_logps, ref_rejected_logps = torch.zeros_like(chosen_logps), torch.zeros_like(rejected_logps)
    elif ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError("dpo_loss needs the reference log-probs unless reference_free=True")
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        if label_smoothing:
            raise ValueError(f'label_smoothing={label_smoothing} applies to loss="sigmoid" only; use 0 with "ipo"')
        losses = (h - 1 / (2 * beta)).square()
    else:
        raise ValueError(f'loss="{loss}": valid DPO losses are {DPO_LOSSES}')
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_sums(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, Mean]:
    """:func:`preference_metrics` as sums and counts over the pairs (detached), so that micro-batches and ranks
    add up before one division. Shapes: [B] each."""
    chosen, rejected = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    pairs = chosen.numel()
    return {
        "rewards/chosen": Mean(chosen.sum(), pairs),
        "rewards/rejected": Mean(rejected.sum(), pairs),
        "rewards/margins": Mean((chosen - rejected).sum(), pairs),
        "rewards/accuracy": Mean((chosen > rejected).sum(), pairs),
    }


def preference_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, float]:
    """Means over the pairs: rewards/chosen, rewards/rejected, rewards/margins (chosen - rejected) and
    rewards/accuracy (the share of pairs whose chosen reward is strictly higher). Shapes: [B] each."""
    return {name: float(m.total / m.count) for name, m in preference_sums(chosen_rewards, rejected_rewards).items()}


def kto_mismatched_pairs(n: int) -> torch.Tensor:
    """[n] int64: the completion each prompt is paired with for KTO's KL baseline, completion i - 1 (mod n),
    as TRL shifts the batch's completions by one. The pairs are (prompt i, completion index[i]); n >= 2."""
    if n < 2:
        raise ValueError(f"KTO's mismatched pairs need >= 2 examples, got {n}")
    return torch.roll(torch.arange(n), 1)


def kto_kl_baseline(mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z_ref = max(0, mean(log pi(y'|x) - log pi_ref(y'|x)))`` over mismatched pairs (x, y'),
    detached (the paper does not backpropagate through it). Shapes: [M] each; returns a scalar.

    Under data parallelism the mean must run over every rank's pairs (all-reduce the sum and the count)."""
    return (mismatched_logps - ref_mismatched_logps).detach().float().mean().clamp(min=0)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    z_ref: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024): a desirable completion loses w_D * (1 - sigmoid(beta (r - z_ref))), an
    undesirable one w_U * (1 - sigmoid(beta (z_ref - r))), with r = log pi(y|x) - log pi_ref(y|x).

    Args:
        logps, ref_logps: [B] policy and reference log-probs of each completion.
        desirable: [B] bool, the label (True = desirable).
        z_ref: the KL baseline from :func:`kto_kl_baseline`.
        beta: e.g. 0.1; desirable_weight, undesirable_weight: the paper's lambda_D, lambda_U (balance
            them so that lambda_D * n_D / (lambda_U * n_U) lies in [1, 4/3]).
    Returns:
        losses [B] (with gradient), rewards [B] (beta * r, detached).
    """
    ratio = logps - ref_logps
    z = torch.as_tensor(z_ref, dtype=ratio.dtype, device=ratio.device)
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(desirable.bool(), good, bad), beta * ratio.detach()


def kto_sums(
    rewards: torch.Tensor, desirable: torch.Tensor, z_ref: torch.Tensor | float, beta: float
) -> dict[str, Mean]:
    """The sums and counts (detached) behind :func:`kto_metrics` but rewards/margins, which is a difference of
    two means: rewards/chosen over the desirable examples, rewards/rejected over the undesirable ones,
    rewards/accuracy over all. Shapes: [B] each."""
    good, values = desirable.bool(), rewards.detach().float()
    point = beta * torch.as_tensor(z_ref, dtype=values.dtype, device=values.device)
    right = torch.where(good, values > point, values < point)
    return {
        "rewards/chosen": Mean(values[good].sum(), good.sum()),
        "rewards/rejected": Mean(values[~good].sum(), (~good).sum()),
        "rewards/accuracy": Mean(right.sum(), values.numel()),
    }


def kto_metrics(rewards: torch.Tensor, desirable: torch.Tensor, z_ref: torch.Tensor | float, beta: float) -> dict:
    """rewards/chosen and rewards/rejected (mean reward of the desirable and the undesirable examples; nan when
    there are none), rewards/margins (their difference), rewards/accuracy (the share of examples on their
    label's side of the baseline: beta * r > beta * z_ref when desirable, < when not) and kto/z_ref."""
    sums = kto_sums(rewards, desirable, z_ref, beta)
    means = {name: float(m.total / m.count) if m.count else math.nan for name, m in sums.items()}
    return {**means, "rewards/margins": means["rewards/chosen"] - means["rewards/rejected"], "kto/z_ref": float(z_ref)}
