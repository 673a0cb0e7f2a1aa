"""Tinker's losses (rlkit.algos.tinker_losses) against values computed by hand from Tinker's definitions."""

import math
import re

import pytest
import torch

from rlkit.algos.tinker_losses import tinker_token_loss
from rlkit.data.datum import MAX_LISTED, Datum, datum_problems, pad_data, rows_problems
from rlkit.workers.primitives import AdamStep

pytestmark = pytest.mark.numeric

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
SAMPLED = torch.tensor([[-1.5, -2.0, -0.1]])  # ratios e^0.5 = 1.6487, 1, e^-0.4 = 0.6703
ADV = torch.tensor([[2.0, -1.0, 3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the last position is padding


def test_cross_entropy_is_the_weighted_negative_log_prob_sum():
    loss = tinker_token_loss("cross_entropy", LOGP, {"weights": torch.tensor([[0.5, 1.0, 7.0]])}, MASK)
    assert loss.sum().item() == pytest.approx(0.5 * 1.0 + 1.0 * 2.0)  # padding's weight 7 counts for nothing


def test_importance_sampling_is_minus_ratio_times_advantage_summed():
    loss = tinker_token_loss("importance_sampling", LOGP, {"logprobs": SAMPLED, "advantages": ADV}, torch.ones(1, 3))
    expected = -(math.exp(0.5) * 2.0 + 1.0 * -1.0 + math.exp(-0.4) * 3.0)
    assert loss.sum().item() == pytest.approx(expected, rel=1e-6)


def test_importance_sampling_gradient_is_minus_ratio_times_advantage():
    logp = LOGP.clone().requires_grad_(True)
    tinker_token_loss("importance_sampling", logp, {"logprobs": SAMPLED, "advantages": ADV}, MASK).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.exp(0.5) * 2.0, 1.0, 0.0]]))


def test_ppo_clips_the_ratio_at_the_absolute_thresholds():
    inputs = {"logprobs": SAMPLED, "advantages": ADV}
    loss = tinker_token_loss("ppo", LOGP, inputs, torch.ones(1, 3), {"clip_low_threshold": 0.9,
                                                                       "clip_high_threshold": 1.1})  # fmt: skip
    # -min(r A, clip(r, 0.9, 1.1) A): 1.6487*2 vs 1.1*2 -> 2.2; 1 * -1; 0.6703*3 vs 0.9*3 -> 2.0109
    assert loss.sum().item() == pytest.approx(-(2.2 - 1.0 + math.exp(-0.4) * 3.0), rel=1e-6)


def test_cispo_weights_the_log_prob_by_the_clipped_detached_ratio():
    logp = LOGP.clone().requires_grad_(True)
    inputs = {"logprobs": SAMPLED, "advantages": ADV}
    loss = tinker_token_loss("cispo", logp, inputs, torch.ones(1, 3))  # default thresholds 0.8, 1.2
    assert loss.sum().item() == pytest.approx(-(1.2 * -1.0 * 2.0 + 1.0 * -2.0 * -1.0 + 0.8 * -0.5 * 3.0), rel=1e-6)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 * 2.0, 1.0, -0.8 * 3.0]]))


def test_bad_data_is_refused_with_every_problem_named():
    data = [Datum(tokens=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3]}), Datum(tokens=[], loss_fn_inputs={})]
    problems = datum_problems(data, "importance_sampling", 257, 64)
    assert any("datum 0: 3 tokens but" in p for p in problems)
    assert any("datum 0" in p and "logprobs, advantages" in p for p in problems)
    assert any("datum 1: no tokens" in p for p in problems)
    assert datum_problems(data, "dro", 257, 64) == ["loss_fn='dro': not supported; use one of cross_entropy, "
                                           "importance_sampling, ppo, cispo"]  # fmt: skip


def test_padded_rows_hold_each_datum_and_nothing_in_the_padding():
    data = [Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": [6, 7], "weights": [0.0, 1.0]}),
            Datum(tokens=[8], loss_fn_inputs={"target_tokens": [9], "weights": [2.0]})]  # fmt: skip
    rows = pad_data(data, "cross_entropy", 3)
    assert rows.input_ids.tolist() == [[5, 6], [8, 0], [0, 0]]
    assert rows.target_tokens.tolist() == [[6, 7], [9, 0], [0, 0]]
    assert rows.mask.tolist() == [[1, 1], [1, 0], [0, 0]]
    assert rows.inputs["weights"].tolist() == [[0, 1], [2, 0], [0, 0]]
    assert rows.lengths == [2, 1, 0]


def ce(tokens, targets, weights) -> Datum:
    return Datum(tokens=tokens, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_datum_field_and_position():
    data = [ce([1, 2, 3], [2, 3, 4], [1.0] * 3), ce([1, 257, 3], [2, 3, 4], [1.0] * 3),
            ce([1, 2], [2, -1], [1.0] * 2), ce([4, 5], [2, 300], [1.0] * 2)]  # fmt: skip
    assert datum_problems(data, "cross_entropy", 257, 64) == [
        "datum 1: tokens[1] = 257 is outside the vocabulary (0 to 256)",
        "datum 2: loss_fn_inputs['target_tokens'][1] = -1 is outside the vocabulary (0 to 256)",
        "datum 3: loss_fn_inputs['target_tokens'][1] = 300 is outside the vocabulary (0 to 256)",
    ]
    assert datum_problems([ce([1.5, 2], [2, 3], [1.0, 1.0])], "cross_entropy", 257, 64) == [
        "datum 0: tokens holds non-integer values; token ids are integers"
    ]


def test_sequences_longer_than_the_context_and_non_finite_floats_are_refused():
    long = ce(list(range(65)), list(range(1, 66)), [1.0] * 65)
    nan = ce([1, 2, 3], [2, 3, 4], [1.0, float("nan"), 1.0])
    huge = Datum(tokens=[1, 2], loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [-1.0, -1e300],
                                                "advantages": [float("inf"), 0.0]})  # fmt: skip
    assert datum_problems([long, nan], "cross_entropy", 257, 64) == [
        "datum 0: 65 tokens, more than the model's context of 64 positions; shorten it",
        "datum 1: loss_fn_inputs['weights'][1] = nan: every value must be finite (in float32)",
    ]
    assert datum_problems([huge], "importance_sampling", 257, 64) == [
        "datum 0: loss_fn_inputs['logprobs'][1] = -inf: every value must be finite (in float32)",
        "datum 0: loss_fn_inputs['advantages'][0] = inf: every value must be finite (in float32)",
    ]


def test_malformed_fields_and_huge_bad_batches_get_a_bounded_answer():
    odd = [Datum(tokens=["a", "b"], loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]}),
           Datum(tokens=[[1, 2], [3]], loss_fn_inputs={"target_tokens": [1], "weights": [1.0]}),
           Datum(tokens=[1, 2], loss_fn_inputs={"target_tokens": [[1, 2]], "weights": [1.0, 1.0]})]  # fmt: skip
    problems = datum_problems(odd, "cross_entropy", 257, 64)
    assert problems[0].startswith("datum 0: tokens is not a list of numbers")
    assert problems[1].startswith("datum 1: tokens is not a list of numbers")
    assert "datum 2: 2 tokens but fields of shapes {\"loss_fn_inputs['target_tokens']\": (1, 2)}" in problems[2]
    many = datum_problems([ce([999], [1], [1.0])] * 10_000, "cross_entropy", 257, 64)
    assert len(many) == MAX_LISTED + 1 and many[-1] == f"... and {10_000 - MAX_LISTED} more"


def test_each_rank_checks_its_padded_rows_against_the_limits():
    rows = pad_data([ce([5, 6], [6, 7], [0.0, 1.0]), ce([8], [9], [2.0])], "cross_entropy", 3)
    assert rows_problems(rows, 257, 64) == []
    assert rows_problems(rows, 9, 1) == ["rows of 2 tokens: more than the context of 1 positions",
                                         "row 1: target_tokens outside the vocabulary (0 to 8)"]  # fmt: skip
    rows.inputs["weights"][2, 1] = float("nan")
    rows.input_ids[0, 0] = -4
    assert rows_problems(rows, 257, 64) == ["row 0: tokens outside the vocabulary (0 to 256)",
                                            "row 2: weights not finite"]  # fmt: skip


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("learning_rate", -1.0, "must be positive and finite"), ("learning_rate", 0.0, "must be positive and finite"),
    ("learning_rate", float("nan"), "must be positive and finite"), ("beta1", 1.0, "must be in [0, 1)"),
    ("beta2", -0.1, "must be in [0, 1)"), ("eps", 0.0, "must be positive and finite"),
    ("weight_decay", -0.01, "must be >= 0 and finite"), ("grad_clip_norm", float("inf"), "must be >= 0"),
])  # fmt: skip
def test_adam_parameters_out_of_range_are_refused_by_name(field, value, rule):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}: {rule}")):
        AdamStep(**{field: value})


def test_every_bad_adam_parameter_is_named_at_once():
    with pytest.raises(ValueError) as err:
        AdamStep(learning_rate=float("inf"), beta2=1.5, eps=-1.0)
    assert str(err.value).count(": must") == 3
