"""The training loss's chunked log-prob path against hand values and the plain autograd path."""

import math

import pytest
import torch

from rlkit.algos import entropy_from_logits
from rlkit.models.logprobs import sampled_logprobs, token_logprobs


def reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature
    return token_logprobs(scaled, tokens, 1.0), entropy_from_logits(scaled)


def test_hand_values():
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    logprobs, entropy = sampled_logprobs(logits, torch.tensor([[1]]), 1.0)
    assert logprobs.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    # temperature 2: softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    logprobs, _ = sampled_logprobs(logits, torch.tensor([[0]]), 2.0)
    assert logprobs.item() == pytest.approx(-math.log(1 + math.sqrt(3.0)), abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradient_match_plain_autograd(chunk_rows, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)
    original = logits.detach().clone()

    logprobs, entropy = sampled_logprobs(logits, tokens, temperature, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((weights * logprobs).sum(), logits)
    expected_lp, expected_ent = reference(logits, tokens, temperature)
    (expected_grad,) = torch.autograd.grad((weights * expected_lp).sum(), logits)

    assert logprobs.shape == entropy.shape == (3, 5) and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, expected_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    assert not entropy.requires_grad
    assert torch.equal(logits.detach(), original), "the caller's fp32 logits were modified in place"


def test_bf16_logits_get_a_bf16_gradient_close_to_the_fp32_path():
    torch.manual_seed(1)
    logits = (2 * torch.randn(2, 4, 64)).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 64, (2, 4))
    logprobs, _ = sampled_logprobs(logits, tokens, 1.0, chunk_rows=3)
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    expected_lp, _ = reference(logits, tokens, 1.0)
    (expected_grad,) = torch.autograd.grad(expected_lp.sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs, expected_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad.float(), expected_grad.float(), atol=1e-2, rtol=0)
