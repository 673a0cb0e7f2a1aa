"""Group estimators by group index (any order, any sizes), REINFORCE++-baseline and DAPO's pieces:
hand values and loop references with shuffled rows."""

import math
import statistics

import pytest
import torch

from rlkit.algos import (
    AdvantageInputs,
    compute_advantages,
    grpo_advantages,
    informative_groups,
    mask_truncated,
    masked_whiten,
    overlong_penalty,
    reinforce_baseline_advantages,
    rloo_advantages,
)


def shuffled_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] rewards and [B] group ids: groups of sizes 2..5 with arbitrary ids, rows in random order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), g) for g, n in zip((7, 0, 42, 3, 11), (3, 5, 2, 4, 3), strict=True)])
    order = torch.randperm(len(ids), generator=gen)
    return torch.rand(len(ids), generator=gen), ids[order]


def members(group: torch.Tensor, i: int) -> list[int]:
    return [j for j in range(len(group)) if group[j] == group[i]]


def test_grpo_by_index_matches_loop_reference_with_shuffled_rows():
    rewards, group = shuffled_groups(30)
    for scale in (True, False):
        adv = grpo_advantages(rewards, group, scale=scale)
        for i in range(len(rewards)):
            mine = [rewards[j].item() for j in members(group, i)]
            expected = rewards[i].item() - statistics.mean(mine)
            if scale:
                expected /= statistics.stdev(mine) + 1e-6
            assert adv[i].item() == pytest.approx(expected, abs=1e-5), (scale, i)


def test_rloo_by_index_matches_loop_reference_with_shuffled_rows():
    rewards, group = shuffled_groups(31)
    adv = rloo_advantages(rewards, group)
    for i in range(len(rewards)):
        others = [rewards[j].item() for j in members(group, i) if j != i]
        assert adv[i].item() == pytest.approx(rewards[i].item() - sum(others) / len(others), abs=1e-6)


def test_group_index_equals_contiguous_blocks_and_follows_a_permutation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])
    blocks = torch.tensor([0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(grpo_advantages(rewards, blocks), grpo_advantages(rewards, 3))
    torch.testing.assert_close(rloo_advantages(rewards, blocks), torch.tensor([1.0, -0.5, -0.5, 1.0, -0.5, -0.5]))
    order = torch.tensor([4, 0, 5, 2, 3, 1])
    torch.testing.assert_close(grpo_advantages(rewards[order], blocks[order]), grpo_advantages(rewards, 3)[order])


def test_groups_of_one_and_bad_indices_are_rejected():
    with pytest.raises(ValueError, match=r"GRPO needs >= 2 samples per group; group\(s\) \[5\] have fewer"):
        grpo_advantages(torch.ones(3), torch.tensor([1, 1, 5]))
    with pytest.raises(ValueError, match="RLOO"):
        rloo_advantages(torch.ones(4), torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match=r"group must be a \[B\] = \[3\] integer tensor"):
        grpo_advantages(torch.ones(3), torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"group must be a \[B\] = \[3\] integer tensor"):
        grpo_advantages(torch.ones(3), torch.tensor([0, 0]))


def test_reinforce_baseline_hand_computed():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    # groups {0, 1} and {2, 3}: centred rewards 0.5, -0.5, 1, -1; spread over tokens: 0.5, 0.5, -0.5, 1, 1, -1, -1
    adv = reinforce_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), mask)
    tokens = [0.5, 0.5, -0.5, 1.0, 1.0, -1.0, -1.0]
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)
    expected = torch.tensor([[0.5, 0.5], [-0.5, mean], [1.0, 1.0], [-1.0, -1.0]])
    expected = ((expected - mean) / std) * mask
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-5)


def test_reinforce_baseline_matches_loop_reference_with_shuffled_rows():
    rewards, group = shuffled_groups(32)
    lengths = torch.randint(1, 6, (len(rewards),), generator=torch.Generator().manual_seed(33))
    mask = (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)).float()
    adv = reinforce_baseline_advantages(rewards, group, mask)
    centred = [rewards[i].item() - statistics.mean(rewards[j].item() for j in members(group, i)) for i in range(17)]
    tokens = [centred[i] for i in range(17) for _ in range(int(lengths[i]))]
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)
    for i in range(17):
        for t in range(5):
            expected = (centred[i] - mean) / std if t < lengths[i] else 0.0
            assert adv[i, t].item() == pytest.approx(expected, abs=1e-5)


def test_registry_groups_by_the_inputs_group_index():
    rewards, group = shuffled_groups(34)
    mask = torch.ones(len(rewards), 3)
    token_rewards = torch.zeros(len(rewards), 3)
    token_rewards[:, -1] = rewards
    x = AdvantageInputs(token_rewards=token_rewards, response_mask=mask, group_size=4, group=group)
    for name, per_seq in (
        ("grpo", grpo_advantages(rewards, group)),
        ("drgrpo", grpo_advantages(rewards, group, scale=False)),
        ("rloo", rloo_advantages(rewards, group)),
    ):
        adv, _ = compute_advantages(name, x)
        torch.testing.assert_close(adv, per_seq.unsqueeze(1) * mask, msg=name)
    adv, ret = compute_advantages("reinforce++-baseline", x)
    torch.testing.assert_close(adv, reinforce_baseline_advantages(rewards, group, mask))
    assert torch.equal(adv, ret)
    valid = adv[mask > 0]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6) and valid.std().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(adv, masked_whiten(adv, mask), atol=1e-5, rtol=1e-5)  # already whitened


# -- DAPO ------------------------------------------------------------------------------------------------------


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([1, 12, 13, 14, 16, 20])
    # max_new_tokens 16, buffer 4: free up to 12 tokens, then -0.25 per token down to -1 at 16 (and beyond)
    out = overlong_penalty(lengths, max_new_tokens=16, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens=16, buffer=4, penalty=0.5), out * 0.5)
    whole = overlong_penalty(torch.tensor([15, 16]), max_new_tokens=16, buffer=16)
    torch.testing.assert_close(whole, torch.tensor([-15 / 16, -1.0]))
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"overlong buffer={bad}: must be in"):
            overlong_penalty(lengths, max_new_tokens=16, buffer=bad)


def test_overlong_penalty_matches_loop_reference():
    lengths = torch.randint(0, 33, (40,), generator=torch.Generator().manual_seed(35))
    out = overlong_penalty(lengths, max_new_tokens=32, buffer=7, penalty=0.3)
    for i, n in enumerate(lengths.tolist()):
        expected = 0.0 if n <= 25 else -0.3 * (n - 25) / 7  # DAPO eq. 13 with L_max = 32, L_cache = 7
        assert out[i].item() == pytest.approx(expected, abs=1e-6)


def test_mask_truncated_zeroes_completions_cut_at_the_budget():
    """A completion cut at max_new_tokens ("length") and a trajectory whose next observation did not fit its token
    budget ("budget") leave the loss; an answer, a finished episode and one out of turns stay."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    out = mask_truncated(mask, ["stop", "length", "stop", "budget", "max_turns"])
    expected = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    torch.testing.assert_close(out, expected)
    mask = mask[:3]
    with pytest.raises(ValueError, match="finish_reason has 2 values for 3 completions"):
        mask_truncated(mask, ["stop", "stop"])


def test_informative_groups_hand_computed_and_loop_reference():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    out = informative_groups(rewards, torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert out.tolist() == [False, False, True, True, False, False, False]  # group 3 has one sample
    assert informative_groups(rewards[:6], 2).tolist() == [False, False, True, True, False, False]
    gen = torch.Generator().manual_seed(36)
    group = torch.randint(0, 9, (50,), generator=gen)
    rewards = torch.randint(0, 2, (50,), generator=gen).float()
    out = informative_groups(rewards, group)
    for i in range(50):
        assert out[i].item() == (len({rewards[j].item() for j in members(group, i)}) > 1)


def test_dynamic_sampling_keeps_the_groups_with_a_gradient():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep = informative_groups(rewards, group)
    adv = grpo_advantages(rewards, group)
    assert (adv[~keep] == 0).all() and (adv[keep] != 0).all()
    # groups [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(adv[keep].abs(), torch.full((4,), 0.5 / (math.sqrt(0.5) + 1e-6)))
