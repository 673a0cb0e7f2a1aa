"""The Batch container: split/concat round trip, the table a person reads."""

import torch

from rlkit.data.batch import Batch
from rlkit.data.prompts import PromptSource
from rlkit.data.rewards import compute_rewards, reward_terms


def make_batch(n=4, t=3) -> Batch:
    return Batch(
        prompts=[f"p{i // 2}" for i in range(n)],
        completions=[f"c{i}" for i in range(n)],
        input_ids=torch.arange(n * (2 + t)).view(n, 2 + t),
        attention_mask=torch.ones(n, 2 + t, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]] * n),
        rollout_logprobs=torch.full((n, t), -1.0),
        old_logprobs=torch.full((n, t), -1.5),
        group=torch.arange(n) // 2,
        finish_reason=["stop", "length"] * (n // 2),
        fields={"answer": [str(i) for i in range(n)]},
        rewards=torch.arange(n, dtype=torch.float32),
    )


def test_split_concat_round_trip():
    batch = make_batch()
    parts = batch.split(2)
    assert [p.completions for p in parts] == [["c0", "c1"], ["c2", "c3"]]
    assert parts[1].fields["answer"] == ["2", "3"]
    joined = Batch.concat(parts)
    assert torch.equal(joined.input_ids, batch.input_ids) and joined.fields == batch.fields
    assert joined.advantages is None


def test_to_pandas_columns_and_gap():
    df = make_batch().to_pandas()
    assert list(df["length"]) == [2, 2, 2, 2]
    assert list(df["answer"]) == ["0", "1", "2", "3"]
    assert df["logprob_gap_max"].tolist() == [0.5] * 4
    assert df["rollout_logprob_mean"].tolist() == [-1.0] * 4


def test_prompt_source_is_seeded_and_resumable():
    items = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    a, b = PromptSource(items, seed=1), PromptSource(items, seed=1)
    first = a.next(7)
    assert first == b.next(7)
    assert sorted(x["prompt"] for x in first[:5]) == [f"q{i}" for i in range(5)]  # one full pass first
    c = PromptSource(items, seed=1)
    c.load_state_dict(a.state_dict())
    assert c.next(3) == a.next(3)


def test_weighted_rewards_sum():
    terms = reward_terms({"one": (lambda p, c, **f: [1.0] * len(c), 0.5), "len": lambda p, c, **f: [len(x) for x in c]})
    total, by_name = compute_rewards(terms, ["a", "b"], ["xy", "z"], {})
    assert total.tolist() == [2.5, 1.5]
    assert by_name["len"].tolist() == [2.0, 1.0]


def test_a_reward_of_none_leaves_the_term_out_of_that_sample_without_renormalising(caplog):
    """TRL's rule: None -> NaN, weighted nansum; a sample no term scored counts 0, with a warning."""
    def math_only(prompts, completions, task):
        return [(1.0 if c == "4" else 0.0) if t == "math" else None for c, t in zip(completions, task, strict=True)]

    def style(prompts, completions, task):
        return [0.5 if t == "chat" else None for t in task]

    terms = reward_terms({"math": (math_only, 2.0), "style": (style, 1.0)})
    fields = {"task": ["math", "math", "chat", "other"]}
    total, by_name = compute_rewards(terms, ["2+2="] * 4, ["4", "5", "hi", "?"], fields)
    assert total.tolist() == [2.0, 0.0, 0.5, 0.0]  # not renormalised: the chat sample keeps style's weight 1
    assert torch.equal(by_name["math"].isnan(), torch.tensor([False, False, True, True]))
    assert "1 sample(s) got None from every reward function and count as reward 0, e.g. sample 3" in caplog.text
    batch = make_batch()
    batch.reward_terms = by_name
    assert batch.to_pandas()["reward/style"].isna().tolist() == [True, True, False, True]


def test_gap_covers_only_the_rows_with_engine_logprobs():
    """Rows 1 and 3 came back without engine log-probs (NaN): the gap and the table skip them, never NaN-poisoned."""
    batch = make_batch()
    batch.rollout_logprob_rows = torch.tensor([True, False, True, False])
    batch.rollout_logprobs[~batch.rollout_logprob_rows] = torch.nan
    batch.old_logprobs[2] = -1.25  # rows 0 and 2 checked: gaps 0.5 and 0.25 on their 2 tokens each
    assert batch.logprob_gap_mean() == 0.375
    df = batch.to_pandas()
    assert df["logprob_gap_max"].tolist()[::2] == [0.5, 0.25] and df["logprob_gap_max"][1::2].isna().all()
    assert df["rollout_logprob_mean"][1::2].isna().all() and df["rollout_logprob_mean"][0] == -1.0
    batch.rollout_logprob_rows[:] = False
    assert batch.logprob_gap_mean() is None
