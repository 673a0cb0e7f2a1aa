"""Numeric comparisons for the tests: a failure names the tensor, the element, the difference and the tolerance, and
tolerances that follow from the computation (AdamW's first step) rather than from the machine a test first ran on.

The numeric tests carry the ``numeric`` marker; ``make test`` runs them again under ``ATEN_CPU_CAPABILITY=default``
and ``=avx2`` (ATen's scalar and AVX2 kernels round differently from the AVX-512 ones), so a tolerance that holds on
one CPU only fails in CI rather than on a user's machine.
"""

from __future__ import annotations

import torch

# A float32 gradient computed in another order (other ranks, padding, kernels) differs from the exact one by up to
# ~6e-7 of the gradient's global norm on the tiny model (measured against float64, on AVX-512, AVX2 and scalar
# kernels); two such computations, compared, by up to twice that. 1e-5 leaves a margin of eight.
GRAD_ERROR_OF_NORM = 1e-5


def assert_close(got: torch.Tensor, expected: torch.Tensor, *, atol: float | torch.Tensor, rtol: float = 0.0,
                 name: str = "tensor") -> None:  # fmt: skip
    """Assert ``|got - expected| <= atol + rtol * |expected|`` element by element (in float64).

    ``atol`` is a number or a tensor of ``expected``'s shape (a tolerance per element). On failure the message gives
    ``name``, how many elements are out, the one furthest beyond its tolerance (index, both values, the difference)
    and the tolerance there. NaN or inf where the other has a finite value counts as out.
    """
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    got64, expected64 = got.detach().double().cpu(), expected.detach().double().cpu()
    diff = (got64 - expected64).abs()
    same = (got64 == expected64) | (got64.isnan() & expected64.isnan())
    diff = torch.where(same, torch.zeros_like(diff), diff.nan_to_num(nan=torch.inf))
    tolerance = torch.as_tensor(atol, dtype=torch.float64).expand_as(diff) + rtol * expected64.abs().nan_to_num(0.0)
    out = ~(diff <= tolerance)
    if not out.any():
        return
    worst = int(torch.where(out, (diff - tolerance).nan_to_num(nan=torch.inf), -torch.inf).flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    raise AssertionError(
        f"{name}: {int(out.sum())} of {diff.numel()} elements differ beyond the tolerance; the furthest at "
        f"{list(index)}: got {got64[index].item():.9g}, expected {expected64[index].item():.9g}, difference "
        f"{diff[index].item():.3g}, tolerance there {tolerance[index].item():.3g}"
    )


def adamw_first_step_tolerance(grad: torch.Tensor, *, lr: float, eps: float, grad_error: float) -> torch.Tensor:
    """[grad's shape] how far AdamW's first update of each element can move when its gradient is off by up to
    ``grad_error``.

    The first step moves an element by ``lr * g / (|g| + eps)`` (bias-corrected moments are ``g`` and ``g**2``), whose
    slope in ``g`` is ``lr * eps / (|g| + eps)**2``: small for ``|g| >> eps``, up to ``lr / eps`` near 0. The bound is
    the steepest slope within ``grad_error`` of ``g`` times ``grad_error``, at most ``2 * lr`` (the update's range).
    """
    nearest = (grad.detach().double().abs() - grad_error).clamp(min=0)
    return (lr * eps / (nearest + eps) ** 2 * grad_error).clamp(max=2 * lr)
