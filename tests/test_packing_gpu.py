"""Packed rows on a GPU (bf16): each attention implementation against the fp32 padded reference, the varlen
kernel actually used, compiled and checkpointed layers (marked gpu; skipped without CUDA)."""

import importlib.util

import pytest
import torch
from packing_cases import TEMPERATURE, WIDTH, reference_logprobs, rows, weighted_loss

import rlkit.models.attention as attention
from rlkit.models.attention import hf_attn_implementation
from rlkit.models.head import install_response_head
from rlkit.models.logprobs import response_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATTNS = [
    "sdpa",
    "flex_attention",
    pytest.param(
        "flash_attention_2",
        marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"),
    ),
]


def model(attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    built = AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation(attn), dtype=dtype)
    install_response_head(built)
    return built.cuda()


def forward_backward(m, padding_free: bool):
    ids, mask = (t.cuda() for t in rows(512))
    m.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(
        m, ids, mask, response_width=WIDTH, temperature=TEMPERATURE, padding_free=padding_free, entropy="grad"
    )
    weighted_loss(lp, ent, mask).backward()
    return lp.detach().float(), {k: v.grad.float() for k, v in m.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    """fp32, padded rows, the plain path."""
    m = model("sdpa", torch.float32)
    ids, mask = (t.cuda() for t in rows(512))
    lp, ent = reference_logprobs(m, ids, mask)
    weighted_loss(lp, ent, mask).backward()
    return lp.detach(), {k: v.grad for k, v in m.named_parameters()}


def assert_close_to(reference, got, label: str) -> None:
    ref_lp, ref_grads = reference
    lp, grads = got
    assert (lp - ref_lp).abs().max() < 5e-2, label
    for name, ref in ref_grads.items():
        rel = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-6)
        assert rel < 5e-2, f"{label}: {name} relative error {rel:.3g}"


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("padding_free", [False, True])
def test_bf16_rows_match_the_fp32_padded_reference(reference, attn, padding_free):
    assert_close_to(reference, forward_backward(model(attn, torch.bfloat16), padding_free), f"{attn} {padding_free}")


def test_packed_sdpa_runs_torchs_varlen_kernel(monkeypatch):
    calls = []
    kernel = attention._flash_varlen
    monkeypatch.setattr(attention, "_flash_varlen", lambda *a: calls.append(1) or kernel(*a))
    forward_backward(model("sdpa", torch.bfloat16), padding_free=True)
    assert len(calls) == 4  # once per layer


def test_compiled_checkpointed_layers_match(reference):
    from torch.distributed._composable import checkpoint

    m = model("sdpa", torch.bfloat16)
    for layer in m.model.layers:
        checkpoint(layer)
        layer.forward = torch.compile(layer.forward)
    for _ in range(2):  # the second call runs the compiled code
        got = forward_backward(m, padding_free=True)
    assert_close_to(reference, got, "compiled + checkpointed")
