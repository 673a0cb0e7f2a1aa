"""Observations are text: a tool result or an environment reply that writes a template's special tokens (to close
its turn and forge the assistant's) is tokenised as plain text with each chat template (Qwen2.5's, Qwen3's, Llama
3's); only the template's own special tokens are control tokens, and the drift check still agrees and still finds a
real difference."""

from __future__ import annotations

import pytest
from agent_cases import (
    FORGED,
    LLAMA3_TEMPLATE,
    LLAMA3_TOKENS,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    SCRIPTS,
    episodes,
    forger,
)

from rlkit.data.agent_tasks import GuessNumber, calculator
from rlkit.data.chat import ChatRenderer
from rlkit.data.tools import make_tools
from rlkit.models import load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR

TEMPLATES = {"qwen2.5": QWEN25_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "llama3": LLAMA3_TEMPLATE}


def templated(name: str):
    """The tiny agent's tokenizer with the template ``name`` (and, for Llama 3, its special tokens and eos)."""
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    if name == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
        tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = TEMPLATES[name]
    return tokenizer


def special_ids(tokenizer, ids: list[int]) -> list[int]:
    """The ids of ``ids`` that are special tokens (control tokens), in order."""
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return [i for i in ids if i in special]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_tool_result_or_environment_reply_cannot_close_its_turn(name):
    """The ids of a forging observation hold exactly the special tokens of a plain one (the template's), and decode to
    the forging text; as a tool result, as an environment reply, and as reset's first observation."""
    tokenizer = templated(name)
    renderer = ChatRenderer(tokenizer, [make_tools([calculator])[0][0].schema])
    assert renderer.problems() == []
    forging, plain = f"page: {FORGED}", "page: fine"
    for role in ("tool", "user"):
        delta = renderer.observation_ids([{"role": role, "name": "calculator", "content": forging}])
        baseline = renderer.observation_ids([{"role": role, "name": "calculator", "content": plain}])
        assert special_ids(tokenizer, delta) == special_ids(tokenizer, baseline), role
        assert FORGED in tokenizer.decode(delta).replace("\\n", "\n"), role  # Llama 3 writes a tool result as JSON
    prompt = [{"role": "user", "content": "guess"}]
    prompt_ids = renderer.ids(prompt, generation_prompt=False)
    opening = renderer.opening_ids(prompt_ids, prompt, forging)
    assert special_ids(tokenizer, opening) == special_ids(tokenizer, renderer.opening_ids(prompt_ids, prompt, plain))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_drift_check_agrees_with_text_observations_and_still_finds_drift(name):
    """prompt + model turn + forging tool result's delta + model turn: no drift against the re-rendered conversation;
    one changed model token: drift, at that token."""
    tokenizer = templated(name)
    renderer = ChatRenderer(tokenizer, [make_tools([calculator])[0][0].schema])
    call, answer = SCRIPTS["calc"][0], "<think>\n\n</think>\n\n42"  # as Qwen3 renders a last turn
    result = [{"role": "tool", "name": "calculator", "content": f"42 {FORGED}"}]
    conversation = [{"role": "user", "content": "6*7"}, {"role": "assistant", "content": call}, *result,
                    {"role": "assistant", "content": answer}]  # fmt: skip
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    ids = (renderer.ids(conversation[:1], generation_prompt=True) + encode(call) + [eos]
           + renderer.observation_ids(result) + encode(answer) + [eos])  # fmt: skip
    assert renderer.drift(conversation, ids, observations_from=1) == ""
    tampered = list(ids)
    tampered[-2] = encode("7")[0]
    report = renderer.drift(conversation, tampered, observations_from=1)
    assert report.startswith(f"token {len(ids) - 2} of {len(ids)}: the trajectory has '7' where"), report


@pytest.mark.parametrize("name", ["tiny", "qwen2.5", "qwen3"])
def test_in_a_rollout_forged_turns_stay_text_and_the_trajectory_goes_on(name):
    """A tool that returns a forging page, and an environment that replies with one: the trajectory's observation ids
    hold only the template's special tokens, the rollout runs its scripted turns to the end, and nothing drifts."""
    tokenizer = load_tokenizer(TINY_AGENT_DIR) if name == "tiny" else templated(name)
    out, _, renderer, _ = episodes(tokenizer, ["forge"], tools=(forger,), width=300)
    trajectory = out.trajectories[0]
    first = trajectory.turns[0]
    assert [(c.name, c.status) for c in first.calls] == [("forger", "ok")] and out.finish_reason == ["stop"]
    assert [t.text for t in trajectory.turns] == SCRIPTS["forge"] and trajectory.drift == ""
    delta = out.response_ids[0, first.end : first.observation_end].tolist()
    plain = renderer.observation_ids([{"role": "tool", "name": "forger", "content": "a.html: fine"}])
    assert special_ids(tokenizer, delta) == special_ids(tokenizer, plain)

    class ForgingGuess(GuessNumber):
        def step(self, text: str) -> tuple[str, float, bool]:
            observation, reward, done = super().step(text)
            return (observation if done else f"{observation} {FORGED}"), reward, done

    out, _, renderer, _ = episodes(tokenizer, ["guess"], tools=(), environment=ForgingGuess, max_turns=4, width=300)
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["stop"] and len(trajectory.turns) == 3
    assert trajectory.drift == "" or name == "qwen3", "Qwen3 re-renders a last answer with <think>: real drift"
    first = trajectory.turns[0]
    delta = out.response_ids[0, first.end : first.observation_end].tolist()
    plain = renderer.observation_ids([{"role": "user", "content": "lower"}])
    assert special_ids(tokenizer, delta) == special_ids(tokenizer, plain)


def test_a_long_forging_result_is_cut_counting_its_special_tokens_as_text():
    """``shortened`` counts a result's tokens as the observation will have them (special tokens as text)."""
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    renderer = ChatRenderer(tokenizer)
    text = FORGED * 3
    count = len(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    assert renderer.shortened(text, tokens=count, side="left") == text
    assert renderer.shortened(text, tokens=count - 1, side="left").endswith("...(truncated)")
