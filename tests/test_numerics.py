"""The tests' numeric helpers (tests/numerics.py): a failure names the tensor, the element, both values, the difference
and the tolerance; AdamW's first-step tolerance bounds what torch's AdamW does with a perturbed gradient."""

import re

import pytest
import torch

from tests.numerics import adamw_first_step_tolerance, assert_close

pytestmark = pytest.mark.numeric


def test_a_failure_names_the_tensor_the_furthest_element_and_its_tolerance():
    expected = torch.zeros(3, 4, dtype=torch.float64)
    got = expected.clone()
    got[1, 2], got[2, 0] = 3e-5, 2e-5  # both out; [1, 2] furthest beyond its tolerance
    with pytest.raises(AssertionError) as failure:
        assert_close(got, expected, atol=1e-6, name="lora_B")
    message = str(failure.value)
    assert message.startswith("lora_B: 2 of 12 elements differ beyond the tolerance; the furthest at [1, 2]")
    assert "got 3e-05, expected 0, difference 3e-05, tolerance there 1e-06" in message


def test_a_tolerance_per_element_and_a_relative_one_are_each_honoured():
    expected = torch.tensor([1.0, 100.0, 0.0])
    assert_close(expected + torch.tensor([0.0, 1e-3, 0.5]), expected, atol=torch.tensor([0.0, 0.0, 0.5]), rtol=1e-5)
    with pytest.raises(AssertionError, match=r"furthest at \[1\].*tolerance there 0.001$"):
        assert_close(expected + torch.tensor([0.0, 2e-3, 0.0]), expected, atol=0.0, rtol=1e-5)


@pytest.mark.parametrize("got, problem", [
    (torch.tensor([float("nan"), 0.0]), "got nan"),
    (torch.tensor([float("inf"), 0.0]), "got inf"),
    (torch.tensor([0.0, 0.0, 0.0]), "shape (3,), expected (2,)"),
])  # fmt: skip
def test_nan_inf_and_a_wrong_shape_fail_by_name(got, problem):
    with pytest.raises(AssertionError, match=re.escape(problem)):
        assert_close(got, torch.zeros(2), atol=1.0, name="x")
    assert_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]), atol=0.0)  # NaN where NaN is expected


def adamw_first_step(grad: torch.Tensor, *, lr: float, eps: float) -> torch.Tensor:
    """[grad's shape] the weights (all 1) after torch's AdamW takes one step with ``grad`` (float64)."""
    weight = torch.nn.Parameter(torch.ones_like(grad, dtype=torch.float64))
    weight.grad = grad.double()
    torch.optim.AdamW([weight], lr=lr, eps=eps, weight_decay=0.1).step()
    return weight.detach()


def test_the_adamw_bound_holds_for_gradients_off_by_the_error_and_is_tight_far_from_eps():
    lr, eps, error = 1e-2, 1e-8, 5e-8
    grad = torch.tensor([0.0, 1e-9, -1e-8, 3e-8, 6e-8, -1e-7, 1e-6, 1e-4, -1e-2, 1.0], dtype=torch.float64)
    tolerance = adamw_first_step_tolerance(grad, lr=lr, eps=eps, grad_error=error)
    exact = adamw_first_step(grad, lr=lr, eps=eps)
    for shift in torch.linspace(-error, error, 41):
        moved = (adamw_first_step(grad + shift, lr=lr, eps=eps) - exact).abs()
        assert (moved <= tolerance * (1 + 1e-9)).all(), (shift, moved, tolerance)
    assert (tolerance[:6] > 1e-3).all()  # within the error of eps: the update may swing by a good part of lr
    assert (tolerance[7:] < 1e-9).all()  # far above eps: the update is lr * sign(g), whatever the rounding
    assert tolerance.max() <= 2 * lr
