"""Tinker's losses (rlkit.algos.tinker_losses) against values computed by hand from Tinker's definitions."""

import math

import pytest
import torch

from rlkit.algos.tinker_losses import tinker_token_loss
from rlkit.data.datum import Datum, datum_problems, pad_data

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
    problems = datum_problems(data, "importance_sampling")
    assert any("datum 0: 3 tokens but" in p for p in problems)
    assert any("datum 0" in p and "logprobs, advantages" in p for p in problems)
    assert any("datum 1: no tokens" in p for p in problems)
    assert datum_problems(data, "dro") == ["loss_fn='dro': not supported; use one of cross_entropy, "
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
