"""The bundled tiny model, its tokenizer, and the addition task it was trained on."""

import random

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkit.data.tasks import EOS_TEXT, AdditionTask, addition_reward
from rlkit.models.tiny import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, local_files_only=True).eval()


def test_loads_offline_as_small_qwen2(tokenizer, model):
    config = model.config
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM's CPU attention needs head_dim >= 32
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.pad_token == EOS_TEXT
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert len(tokenizer) <= config.vocab_size


def test_auto_tokenizer_ids_equal_raw_tokenizer_json(tokenizer):
    raw = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
    rows = AdditionTask().sample(50, random.Random(0))
    texts = [r["prompt"] + r["answer"] + EOS_TEXT for r in rows]
    texts += ["Hello, world! 12 + 3 = 15\n", "  café  naïve\t99+1=100", "'s don't"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(ids) == text


def test_eos_is_one_token(tokenizer):
    assert tokenizer("42" + EOS_TEXT)["input_ids"][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("completion", "expected", "reward"),
    [
        ("42", "42", 1.0),
        ("43", "42", 0.0),
        ("42" + EOS_TEXT, "42", 1.0),
        ("42" + EOS_TEXT + "17" + EOS_TEXT, "42", 1.0),
        (" 42\n", "42", 1.0),
        ("4 2", "42", 0.0),
        ("420", "42", 0.0),
        ("", "42", 0.0),
        (EOS_TEXT + "42", "42", 0.0),
    ],
)
def test_addition_reward_cases(completion, expected, reward):
    assert addition_reward(["17+25="], [completion], answer=[expected]) == [reward]


def test_addition_reward_batch_ignores_extra_fields():
    rewards = addition_reward(["1+1=", "2+2="], ["2", "5"], answer=["2", "4"], source=["a", "b"])
    assert rewards == [1.0, 0.0]


@pytest.mark.parametrize(
    ("prompts", "completions", "answers"),
    [(["1+1="], ["2", "2"], ["2", "2"]), (["1+1=", "1+2="], ["2", "3"], ["2"])],
)
def test_addition_reward_rejects_length_mismatch(prompts, completions, answers):
    with pytest.raises(ValueError, match="length mismatch"):
        addition_reward(prompts, completions, answer=answers)


def test_sample_is_deterministic_and_correct():
    task = AdditionTask(max_operand=20)
    rows = task.sample(100, random.Random(7))
    assert rows == task.sample(100, random.Random(7))
    assert rows != task.sample(100, random.Random(8))
    for row in rows:
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert row["answer"] == str(a + b)


def test_task_rejects_negative_max_operand():
    with pytest.raises(ValueError):
        AdditionTask(max_operand=-1)


@torch.no_grad()
def _accuracy(model, tokenizer, rows, **sampling) -> float:
    prompts = [r["prompt"] for r in rows]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=6, **sampling)
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = addition_reward(prompts, completions, answer=[r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


def test_policy_is_partly_correct_with_room_to_learn(tokenizer, model):
    rows = AdditionTask().sample(256, random.Random(1))  # held out from SFT by build_tiny.py --seed 0
    torch.manual_seed(0)
    sampled = _accuracy(model, tokenizer, rows, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    greedy = _accuracy(model, tokenizer, rows, do_sample=False)
    assert 0.1 <= sampled <= 0.5
    assert greedy >= sampled + 0.3
