"""Padding-free rows against padded ones in one process: layout by hand, log-probs, values, gradients, a step."""

import pytest
import torch
from packing_cases import PROMPT, TEMPERATURE, WIDTH, reference_logprobs, rows, weighted_loss
from transformers import Qwen2Config, Qwen2ForTokenClassification

import rlkit.models.packing as packing
from rlkit.models import load_causal_lm, resolve_model_dir
from rlkit.models.attention import hf_attn_implementation
from rlkit.models.head import ResponseHead
from rlkit.models.logprobs import response_logprobs
from rlkit.models.packing import pack_rows, response_slots
from rlkit.models.value import response_values


@pytest.fixture(scope="module")
def tiny():
    return load_causal_lm(resolve_model_dir("tiny"), dtype=torch.float32, device=torch.device("cpu"))


def test_pack_rows_and_response_slots_by_hand():
    # row 0: prompt [5] (2 pads), response [6, 7]; row 1: prompt [1, 2, 3], response [4] (1 pad)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert packed.cu_seq_lens.tolist() == [0, 3, 7] and packed.cu_seq_lens.dtype == torch.int32
    assert packed.max_length == 4
    assert packed.index.tolist() == [-1, -1, 0, 1, 2, 3, 4, 5, 6, -1]
    slots = response_slots(ids, mask, 2, packed)
    # tokens 6, 7 are predicted at packed 0, 1 (5, 6); token 4 at packed 5 (the 3)
    assert slots.rows.tolist() == [0, 1, 5] and slots.tokens.tolist() == [6, 7, 4] and slots.flat.tolist() == [0, 1, 2]
    assert response_slots(ids, mask, 2).rows.tolist() == [2, 3, 7]  # the same in the padded [2 * 5] layout
    assert slots.scatter(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0], [3.0, 0.0]]


@pytest.mark.parametrize("entropy", ["none", "detached", "grad"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_logprobs_entropy_and_gradients_match_the_plain_padded_path(tiny, padding_free, entropy):
    assert isinstance(tiny.lm_head, ResponseHead) and tiny.lm_head.weight is tiny.model.embed_tokens.weight
    ids, mask = rows(tiny.config.vocab_size)
    tiny.zero_grad()
    ref_lp, ref_ent = reference_logprobs(tiny, ids, mask)
    weighted_loss(ref_lp, ref_ent if entropy == "grad" else None, mask).backward()
    expected = {k: p.grad.clone() for k, p in tiny.named_parameters()}
    tiny.zero_grad()
    lp, ent = response_logprobs(
        tiny, ids, mask, response_width=WIDTH, temperature=TEMPERATURE, padding_free=padding_free, entropy=entropy
    )
    weighted_loss(lp, ent if entropy == "grad" else None, mask).backward()
    assert lp.shape == (len(ids), WIDTH) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    assert (lp[mask[:, -WIDTH:] == 0] == 0).all()
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent, ref_ent.detach(), atol=2e-5, rtol=0)
        assert ent.requires_grad == (entropy == "grad")
    for name, param in tiny.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=2e-6, rtol=1e-4, msg=name)


@pytest.mark.numeric
def test_weights_after_adamw_match(tiny):
    """Held as the sharded tests hold them: entries of noise-level gradient to within 2 lr."""
    from role_runs import assert_adam_step_matches

    ids, mask = rows(tiny.config.vocab_size, seed=1)
    start = {k: v.detach().clone() for k, v in tiny.named_parameters()}

    def step(padding_free: bool) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        tiny.zero_grad()
        optimizer = torch.optim.AdamW(tiny.parameters(), lr=1e-3)
        lp, ent = response_logprobs(
            tiny, ids, mask, response_width=WIDTH, temperature=TEMPERATURE, padding_free=padding_free, entropy="grad"
        )
        loss = weighted_loss(lp, ent, mask)
        loss.backward()
        grads = {k: v.grad.clone() for k, v in tiny.named_parameters()}
        optimizer.step()
        tiny.zero_grad()
        weights = {k: v.detach().clone() for k, v in tiny.named_parameters()}
        with torch.no_grad():
            for k, v in tiny.named_parameters():
                v.copy_(start[k])
        return loss.item(), weights, grads

    (loss, padded, grads), (packed_loss, packed, _) = step(False), step(True)
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    assert_adam_step_matches(packed, padded, grads, 1e-3, "packed")
    for name, value in padded.items():
        assert (value - start[name]).abs().max() > 1e-4, f"{name} did not move"


def corrupt_positions(packed):
    """A relative-position bug: the second half of every packed sequence one position too far."""
    positions = packed.position_ids.clone()
    cu = packed.cu_seq_lens.tolist()
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        positions[0, (s + e) // 2 : e] += 1
    return packing.PackedRows(packed.input_ids, positions, packed.cu_seq_lens, packed.max_length, packed.index)


def drop_a_token(packed):
    """A lost token: the longest sequence's 10th token replaced by its 11th (the row then shifts by one)."""
    ids = packed.input_ids.clone()
    longest = int(packed.cu_seq_lens.diff().argmax())
    start = int(packed.cu_seq_lens[longest])
    ids[0, start + 9 : -1] = packed.input_ids[0, start + 10 :].clone()
    return packing.PackedRows(ids, packed.position_ids, packed.cu_seq_lens, packed.max_length, packed.index)


@pytest.mark.parametrize("corruption", [corrupt_positions, drop_a_token])
def test_the_comparison_catches_a_wrong_position_or_a_dropped_token(tiny, monkeypatch, corruption):
    """The packed-vs-padded comparison above must fail when packing is wrong."""
    ids, mask = rows(tiny.config.vocab_size)
    expected, _ = reference_logprobs(tiny, ids, mask)
    monkeypatch.setattr("rlkit.models.logprobs.pack_rows", lambda *a: corruption(pack_rows(*a)))
    with torch.no_grad():
        got, _ = response_logprobs(tiny, ids, mask, response_width=WIDTH, temperature=TEMPERATURE, padding_free=True)
    assert (got - expected).abs().max() > 1e-2


def test_values_match_padded_and_vanish_at_padding():
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1)
    config._attn_implementation = hf_attn_implementation("sdpa")
    torch.manual_seed(0)
    critic = Qwen2ForTokenClassification(config).eval()
    ids, mask = rows(64)
    full = critic(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[..., 0]
    expected = full[:, PROMPT - 1 : -1] * mask[:, -WIDTH:]
    for padding_free in (False, True):
        values = response_values(critic, ids, mask, response_width=WIDTH, padding_free=padding_free)
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
        (grad,) = torch.autograd.grad(values.sum(), critic.score.weight)
        assert grad.abs().sum() > 0


def test_padding_free_without_the_fused_head_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    ids, mask = rows(64)
    with pytest.raises(ValueError, match="padding_free=True needs the fused response head"):
        response_logprobs(model, ids, mask, response_width=WIDTH, temperature=1.0, padding_free=True)
    logprobs, _ = response_logprobs(model, ids, mask, response_width=WIDTH, temperature=1.0)
    assert (logprobs[mask[:, -WIDTH:] == 0] == 0).all() and (logprobs[mask[:, -WIDTH:] == 1] < 0).all()


def test_forward_settings_are_checked_before_launch(monkeypatch):
    from rlkit import ConfigError, FSDPConfig, GRPOConfig

    with pytest.raises(ConfigError) as err:
        GRPOConfig(attn_implementation="eager", fsdp=FSDPConfig(version=1, compile=True))
    assert len(err.value.problems) == 2
    assert 'attn_implementation="eager": use one of' in str(err.value)
    assert "fsdp.compile=True with version=1" in str(err.value)
    config = GRPOConfig(attn_implementation="flex_attention", fsdp=FSDPConfig(activation_checkpointing=True))
    with pytest.raises(ConfigError, match="no flex attention backward on CPU"):
        config.check_cluster(2, "cpu")
    config.check_cluster(2, "cuda")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="flash-attn is not installed"):
        GRPOConfig(attn_implementation="flash_attention_2").check_cluster(2, "cuda")
    assert GRPOConfig().padding_free and GRPOConfig().attn_implementation == "sdpa"
