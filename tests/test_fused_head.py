"""The fused LM head + log-softmax against plain autograd over the whole [M, V] logits."""

import math

import pytest
import torch

from rlkit.models import load_causal_lm, resolve_model_dir
from rlkit.models.head import ResponseHead, install_response_head, linear_logprobs


def plain(hidden, weight, tokens, temperature):
    """The reference: logits in the inputs' dtype (as lm_head gives them), fp32 log-softmax, entropy."""
    logits = hidden @ weight.t()
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_hand_values():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; at temperature 2: [1, sqrt 3] / (1 + sqrt 3)
    hidden, weight = torch.tensor([[1.0]]), torch.tensor([[0.0], [math.log(3.0)]])
    out = linear_logprobs(hidden, weight, torch.tensor([1]), 1.0)
    assert out[0, 0].item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert out[0, 1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    out = linear_logprobs(hidden, weight, torch.tensor([0]), 2.0, entropy="none")
    assert out[0, 0].item() == pytest.approx(-math.log(1 + math.sqrt(3.0)), abs=1e-6)
    assert out[0, 1].item() == 0.0


@pytest.mark.parametrize("entropy", ["none", "detached", "grad"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_values_and_gradients_match_plain_autograd(entropy, chunk_rows, temperature, dtype, tol):
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, dtype=dtype, requires_grad=True)
    weight = (2 * torch.randn(37, 8, dtype=dtype)).requires_grad_()
    tokens = torch.randint(0, 37, (13,))
    w_lp, w_ent = torch.randn(13, dtype=dtype), torch.randn(13, dtype=dtype)

    out = linear_logprobs(hidden, weight, tokens, temperature, entropy, chunk_rows)
    loss = (w_lp * out[:, 0]).sum() + (w_ent * out[:, 1]).sum()
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_lp, ref_ent = plain(hidden, weight, tokens, temperature)
    ref_loss = (w_lp * ref_lp).sum() + ((w_ent * ref_ent).sum() if entropy == "grad" else 0)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))

    assert out.shape == (13, 2) and out.dtype == dtype
    torch.testing.assert_close(out[:, 0], ref_lp, atol=tol, rtol=0)
    expected_ent = ref_ent if entropy != "none" else torch.zeros(13, dtype=dtype)
    torch.testing.assert_close(out[:, 1], expected_ent, atol=tol, rtol=0)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("entropy", ["detached", "grad"])
def test_bf16_gradients_are_bf16_and_close_to_the_plain_bf16_path(entropy):
    torch.manual_seed(1)
    hidden = torch.randn(20, 16).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(50, 16).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (20,))
    out = linear_logprobs(hidden, weight, tokens, 0.8, entropy, chunk_rows=6)
    grads = torch.autograd.grad(out[:, 0].sum() + out[:, 1].sum(), (hidden, weight))
    ref_lp, ref_ent = plain(hidden, weight, tokens, 0.8)
    ref_grads = torch.autograd.grad(ref_lp.sum() + (ref_ent.sum() if entropy == "grad" else 0), (hidden, weight))
    torch.testing.assert_close(out[:, 0], ref_lp, atol=1e-5, rtol=0)  # the same bf16 logits, fp32 softmax
    for got, expected in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_response_head_is_the_lm_head_outside_scoring_and_keeps_names_and_tying():
    model = load_causal_lm(resolve_model_dir("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    head = model.lm_head
    assert isinstance(head, ResponseHead) and install_response_head(model)
    assert head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" in model.state_dict() and head.bias is None
    hidden = torch.randn(2, 3, model.config.hidden_size)
    torch.testing.assert_close(head(hidden), hidden @ head.weight.t())
    rows, tokens = torch.tensor([0, 4]), torch.tensor([7, 9])
    with torch.no_grad(), head.scoring(rows, tokens, 1.0, "detached"):
        out = head(hidden)
    expected_lp, expected_ent = plain(hidden.reshape(6, -1)[rows], head.weight, tokens, 1.0)
    torch.testing.assert_close(out, torch.stack([expected_lp, expected_ent], 1))
    assert head(hidden).shape == (2, 3, model.config.vocab_size), "the request outlived its block"
    with pytest.raises(ValueError, match="entropy='grads'"), head.scoring(rows, tokens, 1.0, "grads"):
        pass


def test_a_cpu_head_runs_the_eager_math_and_a_failed_compile_falls_back_to_it(monkeypatch, caplog):
    """On a GPU the head compiles its chunk math (tests/test_gpu.py checks it against eager); where compiling
    fails it says why once and runs the eager math, with the same results."""
    import torch._dynamo.exc

    import rlkit.models.head as head_module

    head = ResponseHead(torch.nn.Linear(8, 33, bias=False))
    assert head.chunk_math is None  # picked by the device at the first scoring forward
    with head.scoring(torch.tensor([1, 3, 6]), torch.tensor([2, 4, 7]), 1.0, "detached"):
        head(torch.randn(2, 5, 8))
    assert head.chunk_math is head_module.EAGER

    def broken(fn):
        def call(*args):
            error = RuntimeError("NoValidChoicesError")
            raise torch._dynamo.exc.BackendCompilerFailed(fn, error, first_useful_frame=None)
        return call

    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(3)
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(33, 8, requires_grad=True)
    tokens = torch.randint(0, 33, (9,))
    results = []
    for chunk_math in (head_module.EAGER, head_module.fused_chunk_math()):
        out = linear_logprobs(hidden, weight, tokens, 0.8, "grad", chunk_rows=3, math=chunk_math)
        results.append((out, *torch.autograd.grad(out.sum(), (hidden, weight))))
    for eager, fallen_back in zip(*results, strict=True):
        torch.testing.assert_close(fallen_back, eager, atol=0, rtol=0)
    assert "did not compile (BackendCompilerFailed" in caplog.text and "runs eagerly" in caplog.text
    assert caplog.text.count("did not compile") == 2  # stats and grad, once each


@pytest.mark.slow
def test_compiled_chunk_math_matches_eager():
    """What FSDPConfig.compile switches the head to (compiling takes ~30 s on 2 CPU cores)."""
    from rlkit.models.head import fused_chunk_math

    torch.manual_seed(2)
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(33, 8, requires_grad=True)
    tokens = torch.randint(0, 33, (9,))
    results = []
    for chunk_math in (None, fused_chunk_math()):
        out = linear_logprobs(hidden, weight, tokens, 0.8, "grad", chunk_rows=3, math=chunk_math)
        results.append((out, *torch.autograd.grad(out.sum(), (hidden, weight))))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
