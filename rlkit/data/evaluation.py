"""Validation metrics from per-sample rewards: mean reward per term and pass@k for binary rewards.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex): with n samples of a prompt of
which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), the chance that at least one of k
samples drawn without replacement is correct, averaged over prompts.
"""

from __future__ import annotations

import math

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for ``n`` samples, ``c`` correct, ``k <= n``.

    Example:
        >>> pass_at_k(4, 1, 2)  # one of 4 samples right: 2 draws find it half the time
        0.5
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 1, 2, 4, ... below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def validation_metrics(
    total: torch.Tensor, terms: dict[str, torch.Tensor], group: torch.Tensor, prefix: str = "val"
) -> dict[str, float]:
    """The ``val/...`` metrics of one validation pass.

    Args:
        total: [N] the weighted total reward of each sample.
        terms: each reward term's [N] values.
        group: [N] the prompt each sample belongs to (any ids; every prompt has the same count n).
    Returns:
        ``val/reward/mean`` and ``val/reward/<term>/mean`` (over the samples the term scored: NaN is a None);
        for every binary (all 0/1) one of them also
        ``val/reward[/<term>]/pass@k`` for k in :func:`pass_ks`; ``val/prompts`` and ``val/samples``.
    """
    _, counts = torch.unique(group, return_counts=True)
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"every validation prompt needs the same number of samples, got counts {counts.tolist()}")
    out = {f"{prefix}/prompts": float(len(counts)), f"{prefix}/samples": float(len(group))}
    for name, values in [("reward", total), *((f"reward/{n}", v) for n, v in terms.items())]:
        out[f"{prefix}/{name}/mean"] = values.float().nanmean().item()  # a term's None samples are left out
        if bool(((values == 0) | (values == 1)).all()):  # binary, and scored every sample
            out |= {f"{prefix}/{name}/pass@{k}": v for k, v in _pass_rates(values, group).items()}
    return out


def _pass_rates(correct: torch.Tensor, group: torch.Tensor) -> dict[int, float]:
    """pass@k averaged over prompts, for each k of :func:`pass_ks`; ``correct`` is [N] 0/1."""
    ids, inverse = torch.unique(group, return_inverse=True)
    hits = torch.zeros(len(ids), dtype=torch.long).index_add_(0, inverse, correct.long()).tolist()
    n = len(group) // len(ids)
    return {k: sum(pass_at_k(n, c, k) for c in hits) / len(hits) for k in pass_ks(n)}
