"""Multi-turn rollouts in one process: tool schemas and parsers, concurrent calls, token deltas and drift, and the
episode loop on a scripted engine (token in / token out, the loss mask at every position, each limit and failure)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
from agent_cases import (
    QWEN3_TEMPLATE,
    QWEN3_THINKING_TEMPLATE,
    SCRIPTS,
    EchoProcess,
    Tally,
    async_calculator,
    broken,
    count_to,
    episodes,
    slow,
)

from rlkit.algos import loss_weights
from rlkit.data.agent_tasks import GuessNumber, calculator
from rlkit.data.agents import agent_tools
from rlkit.data.chat import ChatRenderer
from rlkit.data.tools import make_tools, parse_hermes, parse_mistral
from rlkit.models import load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR
from rlkit.rollout.calls import CallRunner, call
from rlkit.trainer.agentic import failure_summary


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_AGENT_DIR)


# -- tools, parsers, calls ---------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_says_why_one_cannot_be_read():
    text = 'a<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "g", "arguments": "{}"}'
    good, unclosed = parse_hermes(text)
    assert (good.name, good.arguments, good.error) == ("f", {"x": 1}, "")
    assert unclosed.error == "<tool_call> is never closed"
    assert parse_hermes("<tool_call>{nope</tool_call>")[0].error.startswith("the call is not JSON")
    nameless, listed = parse_hermes('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": [1]}'
                                    "</tool_call>")  # fmt: skip
    assert nameless.error == 'the call is not an object with a "name"'
    assert listed.error == '"arguments" is not an object'
    assert parse_hermes("no calls here") == []


def test_mistral_parser_reads_a_list_of_calls():
    calls = parse_mistral('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}] tail')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_mistral("[TOOL_CALLS] {oops")[0].error.startswith("the calls are not JSON")


def test_tool_schema_comes_from_the_signature_and_docstring():
    tools, problems = make_tools([calculator])
    assert problems == []
    function = tools[0].schema["function"]
    assert function["name"] == "calculator" and function["parameters"]["required"] == ["expression"]
    assert "whole-number" in function["description"]

    def undocumented(x: int) -> int:
        return x

    _, problems = make_tools([undocumented, calculator, calculator])
    assert "tool test_tool_schema_comes_from_the_signature_and_docstring.<locals>.undocumented" in problems[0]
    assert "Args: section" in problems[0]
    assert "several tools are named ['calculator']" in problems[1]


def test_calls_run_at_once_and_a_hung_one_times_out():
    barrier, hung = threading.Barrier(3, timeout=5), threading.Event()
    functions = [barrier.wait] * 3 + [lambda: hung.wait(60), lambda: 1 / 0, asyncio.Event().wait]
    runner = CallRunner()
    try:  # the barrier only opens when the three run at the same time
        outcomes = runner.run_all([lambda f=f: call(f) for f in functions], timeout=1.0)
    finally:
        runner.close()
    assert [o.error is None and not o.timed_out for o in outcomes[:3]] == [True] * 3
    assert outcomes[3].timed_out and outcomes[3].seconds == 1.0 and outcomes[5].timed_out
    assert isinstance(outcomes[4].error, ZeroDivisionError)
    hung.set()


# -- token deltas and drift ----------------------------------------------------------------------


def test_observation_deltas_rebuild_the_full_render_with_the_boundary_newline(tokenizer):
    """Prompt ids + each model turn's ids through <|im_end|> + each observation delta == the whole conversation
    rendered at once; the "\\n" the template writes after <|im_end|> opens the delta (it is not the model's)."""
    renderer = ChatRenderer(tokenizer, [make_tools([calculator])[0][0].schema])
    call = SCRIPTS["two_calls"][0]
    results = [{"role": "tool", "content": "2"}, {"role": "tool", "content": "2"}]  # two parallel results
    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": call}, *results,
                    {"role": "assistant", "content": "2"}]  # fmt: skip
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    delta = renderer.observation_ids(results)
    ids = renderer.ids(conversation[:1], generation_prompt=True) + encode(call) + [eos] + delta + encode("2") + [eos]
    full = renderer.ids(conversation, generation_prompt=False)
    assert full[: len(ids)] == ids and tokenizer.decode(full[len(ids) :]) == "\n"
    assert tokenizer.decode(delta[:1]) == "\n" and delta.count(tokenizer.convert_tokens_to_ids("<tool_response>")) == 2
    assert renderer.drift(conversation, ids) == ""


def test_a_drifting_template_is_reported_with_position_and_context(tokenizer):
    """A template that drops earlier assistant turns (as templates that strip old reasoning do): the trajectory's ids
    no longer match the re-render, and the drift names the first differing token and shows both sides."""
    renderer = ChatRenderer(tokenizer)
    conversation = [{"role": "user", "content": "guess 1-99"}, {"role": "assistant", "content": "50"},
                    {"role": "user", "content": "lower"}, {"role": "assistant", "content": "25"}]  # fmt: skip
    ids = renderer.ids(conversation, generation_prompt=False)
    assert renderer.drift(conversation, ids) == ""
    earlier_dropped = (
        "{% if message.role == 'assistant' and not loop.last %}…{% else %}{{ message.content }}{% endif %}"
    )
    drifting = tokenizer.chat_template.replace("{{ message.content }}", earlier_dropped)
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    tokenizer.chat_template = drifting
    report = ChatRenderer(tokenizer).drift(conversation, ids)
    position = len(ChatRenderer(tokenizer).ids(conversation[:1], generation_prompt=True))
    assert report.startswith(f"token {position} of {len(ids)}: the trajectory has '5' where the re-rendered")
    assert "'…" in report and "after '" in report


def test_templates_that_cannot_append_turns_are_named(tokenizer):
    plain = load_tokenizer(TINY_AGENT_DIR)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert "does not end an assistant turn with the eos token '<|im_end|>'" in ChatRenderer(plain).problems()[0]
    schemas = [make_tools([calculator])[0][0].schema]
    plain.chat_template = tokenizer.chat_template.replace("{% if tools %}", "{% if false %}")
    assert "ignores tools" in ChatRenderer(plain, schemas).problems()[0]
    plain.chat_template = None
    assert "has none" in ChatRenderer(plain).problems()[0]
    assert ChatRenderer(tokenizer, schemas).problems() == []


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, QWEN3_THINKING_TEMPLATE], ids=["qwen3", "thinking"])
def test_qwen3_templates_run_tools_and_environments(template):
    """Qwen3 writes an empty ``<think></think>`` into an assistant turn only when it is the last message, so the
    stand-in renders differently once messages follow; what the engine sees next (the tokens after the turn's
    <|im_end|>) is what counts. With tools and with an environment, on Qwen3's template and a thinking model's."""
    qwen3 = load_tokenizer(TINY_AGENT_DIR)
    qwen3.chat_template = template
    opening = "<|im_start|>assistant\n" + ("<think>\n" if template is QWEN3_THINKING_TEMPLATE else "")
    schemas = [make_tools([calculator])[0][0].schema]
    assert ChatRenderer(qwen3, schemas).problems() == [] and ChatRenderer(qwen3).problems() == []
    out, _, _, _ = episodes(qwen3, ["think_calc"], width=150)
    trajectory = out.trajectories[0]
    assert [(c.name, c.status, c.result) for c in trajectory.turns[0].calls] == [("calculator", "ok", "42")]
    assert out.finish_reason == ["stop"] and len(trajectory.turns) == 2
    assert trajectory.drift == "" or template is QWEN3_THINKING_TEMPLATE, "Qwen3 keeps the reasoning of tool turns"
    delta = out.response_ids[0, trajectory.turns[0].end : trajectory.turns[0].observation_end].tolist()
    assert qwen3.decode(delta) == f"\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n{opening}"
    out, _, _, _ = episodes(qwen3, ["guess"], tools=(), environment=GuessNumber, max_turns=4)
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["stop"] and [t.observation for t in trajectory.turns] == ["lower", "higher", "correct"]
    first = trajectory.turns[0]
    delta = out.response_ids[0, first.end : first.observation_end].tolist()
    assert qwen3.decode(delta) == f"\n<|im_start|>user\nlower<|im_end|>\n{opening}"


# -- the episode loop -----------------------------------------------------------------------------


def test_token_in_token_out_and_the_loss_mask_at_every_position(tokenizer):
    """A hand-built two-turn trajectory (a calculator call, then the answer): the response is the engine's ids of
    turn 0, the tool result's delta, the engine's ids of turn 1; mask, log-probs, attention and turn index are
    checked at every position."""
    out, engine, renderer, _ = episodes(tokenizer, ["calc"])
    eos = tokenizer.eos_token_id
    turn0, turn1 = (tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in SCRIPTS["calc"])
    tool = renderer.observation_ids([{"role": "tool", "name": "calculator", "content": "42"}])
    expected = turn0 + tool + turn1
    n0, nt, n1 = len(turn0), len(tool), len(turn1)
    width = out.response_ids.shape[1]
    assert out.response_ids[0, : len(expected)].tolist() == expected
    assert (out.response_ids[0, len(expected) :] == tokenizer.pad_token_id).all()
    assert out.response_mask[0].tolist() == [1.0] * n0 + [0.0] * nt + [1.0] * n1 + [0.0] * (width - len(expected))
    assert out.response_attention[0].tolist() == [1] * len(expected) + [0] * (width - len(expected))
    assert out.turn_index[0].tolist() == [0] * (n0 + nt) + [1] * n1 + [-1] * (width - len(expected))
    engine_logprobs = [-(t + 1) / 100 for t in range(n0)] + [0.0] * nt + [-(t + 1) / 100 for t in range(n1)]
    torch.testing.assert_close(out.logprobs[0], torch.tensor(engine_logprobs + [0.0] * (width - len(expected))))
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["stop"] and trajectory.finish_reason == "stop" and trajectory.drift == ""
    assert [t.finish for t in trajectory.turns] == ["tool_calls", "stop"]
    assert [(c.name, c.status, c.result) for c in trajectory.turns[0].calls] == [("calculator", "ok", "42")]
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert engine.calls == [(1, 90), (1, 90 - n0 - nt)], "one engine call per turn, max_new_tokens = budget left"


def test_loss_weights_of_a_trajectory_count_its_model_tokens_only():
    """Every aggregation mode on a mask with holes means what it means on the model's tokens: 3 + 2 model tokens in
    a row of 9 (2 observation tokens, 2 padding), and a single-turn row of 4."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    expected = {
        "token-mean": mask / 9,
        "seq-mean-token-mean": mask / torch.tensor([[5.0], [4.0]]) / 2,
        "seq-mean-token-sum": mask / 2,
        "seq-mean-token-sum-norm": mask / (9 * 2),
        "token-sum": mask,
    }
    for mode, weights in expected.items():
        torch.testing.assert_close(loss_weights(mask, mode, num_tokens=9, num_seqs=2, horizon=9), weights, msg=mode)


def test_each_limit_and_failure_is_named_recorded_and_loses_nothing(tokenizer, caplog):
    scripts = ["slow", "broken", "garbage", "unknown", "bad_args", "loop", "ramble", "answer", "two_calls"]
    with caplog.at_level("INFO", logger="rlkit.rollout.episodes"):  # every failure in the rank's log
        out, _, _, _ = episodes(tokenizer, scripts, tools=(calculator, slow, broken), max_turns=3, width=250)
    assert len(out.trajectories) == len(scripts) and out.response_ids.shape[0] == len(scripts), "nothing lost"
    by_script = dict(zip(scripts, out.trajectories, strict=True))
    statuses = {s: [c.status for c in by_script[s].turns[0].calls] for s in scripts[:5]}
    assert statuses == {"slow": ["timeout"], "broken": ["error"], "garbage": ["unparsable"],
                        "unknown": ["unknown_tool"], "bad_args": ["bad_arguments"]}  # fmt: skip
    assert by_script["broken"].turns[0].calls[0].result == "error: broken raised RuntimeError: broken was given 1"
    assert by_script["slow"].turns[0].calls[0].result == "error: slow took longer than 1 s"
    for script in scripts[:5]:  # a failed call is an error message the model reads; the trajectory goes on
        assert by_script[script].finish_reason == "stop" and len(by_script[script].turns) == 2, script
    assert by_script["loop"].finish_reason == "max_turns" and len(by_script["loop"].turns) == 3
    assert by_script["ramble"].finish_reason == "length" and by_script["ramble"].turns[0].calls == []
    assert by_script["two_calls"].turns[0].calls[1].result == "2"
    assert "trajectory 10, turn 0, call 0 (slow): timeout" in caplog.text  # named by batch row, turn and call
    assert "trajectory 11, turn 0, call 0 (broken): error: broken raised RuntimeError" in caplog.text
    assert "trajectory 12, turn 0, call 0 (unreadable): unparsable" in caplog.text
    assert all(r.levelname == "INFO" for r in caplog.records), "the terminal gets the step's summary only"
    batch = batch_ending(out.finish_reason)
    batch.trajectories = out.trajectories
    assert failure_summary(batch) == ("5 of 9 tool calls failed (1 bad_arguments, 1 error, 1 timeout, 1 unknown_tool, "
                                      "1 unparsable): details in the rank logs and batch.turns_frame()")  # fmt: skip


def test_tool_calls_past_the_limits_are_not_run_and_long_results_are_cut(tokenizer):
    """agent.max_parallel_calls: the calls of a turn past it are not run (the model reads why); calls whose results
    could never be shown (the last turn) are not run at all; a result over agent.max_tool_response_tokens is cut on
    agent.tool_response_truncate_side."""
    out, _, _, _ = episodes(tokenizer, ["two_calls"], max_parallel_calls=1)
    calls = out.trajectories[0].turns[0].calls
    assert [(c.status, c.result) for c in calls] == [("ok", "2"), ("over_limit", "error: not run: at most 1 call "
                                                     "per turn (agent.max_parallel_calls)")]  # fmt: skip
    out, _, _, _ = episodes(tokenizer, ["broken", "calc"], tools=(calculator, broken), max_turns=1)
    assert out.finish_reason == ["max_turns", "max_turns"]
    assert [[(c.status, c.result) for c in t.turns[0].calls] for t in out.trajectories] == [[("not_run", "")]] * 2
    assert [t.failed_calls for t in out.trajectories] == [0, 0]
    cut = {}
    for side in ("left", "right", "middle"):
        out, _, _, _ = episodes(tokenizer, ["count"], tools=(count_to,), width=200, max_tool_response_tokens=8,
                                tool_response_truncate_side=side)  # fmt: skip
        cut[side] = out.trajectories[0].turns[0].calls[0].result
    assert cut["left"].startswith("0 1 2 3") and cut["left"].endswith("...(truncated)")
    assert cut["right"].startswith("(truncated)...") and cut["right"].endswith("38 39")
    assert cut["middle"].startswith("0 1") and "...(truncated)..." in cut["middle"] and cut["middle"].endswith("39")
    for text in cut.values():  # 8 tokens of the result are kept
        kept = text.replace("...(truncated)...", "").replace("...(truncated)", "").replace("(truncated)...", "")
        assert len(tokenizer(kept, add_special_tokens=False)["input_ids"]) <= 8, text


def test_the_budget_ends_a_trajectory_before_an_observation_that_does_not_fit(tokenizer):
    """A budget of exactly the call and its result: no token would be left for the answer, so the result is not
    appended and the trajectory ends ("budget") on its last model token."""
    call = len(tokenizer(SCRIPTS["calc"][0], add_special_tokens=False)["input_ids"]) + 1
    result = ChatRenderer(tokenizer).observation_ids([{"role": "tool", "content": "42"}])
    out, _, _, _ = episodes(tokenizer, ["calc"], width=call + len(result))
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["budget"] and len(trajectory.turns) == 1
    assert trajectory.turns[0].observation == "42" and trajectory.turns[0].observation_end == trajectory.turns[0].end
    assert out.response_attention[0].sum() == out.response_mask[0].sum(), "the observation was not appended"


class AsyncGuess(GuessNumber):
    async def step(self, text: str) -> tuple[str, float, bool]:
        await asyncio.sleep(0)
        return super().step(text)


class BrokenStep(GuessNumber):
    def step(self, text: str) -> tuple[str, float, bool]:
        raise ValueError("the board fell over")


class BrokenReset(GuessNumber):
    def reset(self, **fields) -> None:
        raise KeyError("secret")


@pytest.mark.parametrize("environment", [GuessNumber, AsyncGuess])
def test_an_environment_plays_turns_with_rewards(tokenizer, environment):
    out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=environment, max_turns=4)
    trajectory = out.trajectories[0]
    assert [t.text for t in trajectory.turns] == ["50", "25", "37"]
    assert [t.observation for t in trajectory.turns] == ["lower", "higher", "correct"]
    assert [t.reward for t in trajectory.turns] == [0.0, 0.0, 1.0] and trajectory.env_reward == 1.0
    assert trajectory.finish_reason == "stop" and trajectory.drift == ""
    assert [m["content"] for m in trajectory.messages if m["role"] == "user"] == ["guess", "lower", "higher"]


def test_async_tools_are_awaited_and_an_async_environment_keeps_its_subprocess_across_turns(tokenizer):
    """An ``async def`` tool's result is what the model reads (not a coroutine object); an async environment that
    starts a subprocess in reset talks to it at every step and ends it in close (one event loop for all of them)."""
    out, _, _, _ = episodes(tokenizer, ["async_calc"], tools=(async_calculator,))
    calls = out.trajectories[0].turns[0].calls
    assert [(c.name, c.status, c.result) for c in calls] == [("async_calculator", "ok", "42")]
    assert out.finish_reason == ["stop"]
    out, _, _, _ = episodes(tokenizer, ["guess", "guess"], tools=(), environment=EchoProcess, max_turns=4)
    assert out.finish_reason == ["stop", "stop"], [t.error for t in out.trajectories]
    for trajectory in out.trajectories:
        observations = [t.observation for t in trajectory.turns]
        pid = observations[0].rsplit(" ", 1)[1]
        assert observations == [f"echo {g} from {pid}" for g in ("50", "25", "37")], "one process from reset on"
        assert [t.reward for t in trajectory.turns] == [1.0, 2.0, 3.0]
        with pytest.raises(ProcessLookupError):  # close() ended it (and reaped it)
            os.kill(int(pid), 0)


def test_an_environment_whose_methods_are_the_tools_keeps_state_per_trajectory(tokenizer):
    """TRL's environment_factory: an environment without step offers its public methods as tools, each trajectory
    calling its own instance; get_reward, once the trajectory is over, is its last turn's reward."""
    tools, problems = agent_tools([calculator], Tally)
    assert problems == [] and [t.name for t in tools] == ["calculator", "add"]
    assert tools[1].schema["function"]["parameters"]["required"] == ["amount"], "self is not a parameter"
    out, _, _, _ = episodes(tokenizer, ["tally", "tally"], tools=(), environment=Tally, width=200)
    for trajectory in out.trajectories:
        assert [[c.result for c in t.calls] for t in trajectory.turns] == [["2"], ["5"], []], "one tally each"
        assert trajectory.finish_reason == "stop" and trajectory.env_reward == 5.0
        assert trajectory.turns[-1].reward == 5.0


class Announced(GuessNumber):
    def reset(self, *, secret: str, **fields) -> str:
        super().reset(secret=secret)
        return "I picked a number"


class GymStyle(GuessNumber):
    def reset(self, *, secret: str, **fields) -> tuple:
        super().reset(secret=secret)
        return "gym-style", {}


def test_what_reset_returns_is_the_first_observation(tokenizer):
    """A run with an environment renders its prompts without the generation prompt; each trajectory opens with
    reset's text as a user message (when it gives one) and the generation prompt, out of the loss."""
    out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=Announced, max_turns=4)
    trajectory = out.trajectories[0]
    assert [m["content"] for m in trajectory.messages[:3]] == ["guess", "I picked a number", "50"]
    start = trajectory.turns[0].start
    opening = "<|im_start|>user\nI picked a number<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(out.response_ids[0, :start]) == opening and out.response_mask[0, :start].sum() == 0
    assert trajectory.finish_reason == "stop" and trajectory.drift == "" and len(trajectory.turns) == 3
    out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=GuessNumber, max_turns=4)
    start = out.trajectories[0].turns[0].start
    assert tokenizer.decode(out.response_ids[0, :start]) == "<|im_start|>assistant\n", "no observation: the turn opens"
    out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=GymStyle)
    error = out.trajectories[0].error
    assert "reset returned ('gym-style', {}) (tuple): return the first observation as a str" in error


def test_a_failing_environment_ends_its_trajectory_named_and_kept(tokenizer):
    out, _, _, _ = episodes(tokenizer, ["guess", "guess"], tools=(), environment=BrokenStep, max_turns=4)
    assert out.finish_reason == ["env_error", "env_error"]
    assert out.trajectories[1].error == (
        "trajectory 11, turn 0: the environment's step failed: ValueError: the board fell over"
    )
    assert len(out.trajectories[1].turns) == 1 and out.response_mask[1].sum() == 3, "the turn is kept"
    out, engine, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=BrokenReset)
    assert out.finish_reason == ["env_error"] and out.trajectories[0].turns == [] and engine.calls == []
    assert out.trajectories[0].error == "trajectory 10: the environment's reset failed: KeyError('secret')"


# -- from a TOML file ----------------------------------------------------------------------------

TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def undocumented(a: int) -> int:
    return a
'''
ENV_FILE = '''
class Counter:
    def reset(self, **fields):
        self.n = 0

    def step(self, text):
        self.n += 1
        return "again", 0.0, self.n >= 2


class NoStep:
    def reset(self, **fields):
        pass
'''


def write_run(folder, environment: str, tools: list[str]):
    from rlkit.config import config_from_toml

    (folder / "my_tools.py").write_text(TOOLS_FILE)
    (folder / "my_env.py").write_text(ENV_FILE)
    entries = "".join(f'[[tools]]\nfunction = "{t}"\n' for t in tools)
    toml = f'model = "tiny-agent"\nenvironment = "{environment}"\n[agent]\nmax_turns = 3\n{entries}'
    (folder / "run.toml").write_text(toml)
    return config_from_toml(folder / "run.toml")


def test_a_new_users_mistakes_are_named_with_their_fix(tokenizer, tmp_path):
    """[tools] for [[tools]], tools=calculator for tools=[calculator], [agent] without tools or an environment,
    turn_rewards with a group estimator, and tools on the tiny model: each a message naming the fix."""
    from rlkit.config import ConfigError, GRPOConfig, config_from_toml
    from rlkit.data import load_run_data
    from rlkit.data.agent_tasks import answer_reward as add
    from rlkit.models.tiny import TINY_MODEL_DIR

    (tmp_path / "run.toml").write_text('model = "tiny-agent"\n[tools]\nfunction = "my_tools.py:add"\n')
    with pytest.raises(ConfigError, match=r"tools is one table where a list is expected: in TOML write \[\[tools\]\]"):
        config_from_toml(tmp_path / "run.toml")
    with pytest.raises(ConfigError, match=r"tools=calculator: give a list of functions, tools=\[calculator\]"):
        load_run_data(GRPOConfig(model="tiny-agent"), tokenizer, tools=calculator)
    rows = [{"prompt": "1+1", "answer": "2"}]
    with pytest.raises(ConfigError, match=r"\[agent\] is set, but the run has no tools and no environment"):
        load_run_data(GRPOConfig(model="tiny", agent={"max_turns": 2}), tokenizer, prompts=rows, reward_fn=add)
    with pytest.raises(ConfigError, match='agent.turn_rewards = true with advantage="grpo": a group estimator'):
        GRPOConfig(agent={"turn_rewards": True})
    with pytest.raises(ConfigError, match='model="tiny" has no chat template for tools .* use model="tiny-agent"'):
        load_run_data(GRPOConfig(model="tiny"), load_tokenizer(TINY_MODEL_DIR), prompts=rows, tools=[calculator],
                      reward_fn=add)  # fmt: skip


def test_a_tool_file_imports_the_modules_beside_it_and_they_travel_with_it(tmp_path):
    """As Python runs a script: the file's folder is on the path while it imports, and what it imports from there
    travels to the workers by value with its functions (a process that cannot see the folder runs them)."""
    import subprocess
    import sys

    import cloudpickle

    from rlkit.data.named_rewards import resolve_object

    (tmp_path / "helpers_beside.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "tools_file.py").write_text('from helpers_beside import double\n\n\ndef twice(x: int) -> int:\n'
                                            '    """Twice.\n\n    Args:\n        x: a number.\n    """\n'
                                            "    return double(x)\n")  # fmt: skip
    fn, problem = resolve_object("tools_file.py:twice", tmp_path, {})
    assert problem == "" and fn(2) == 4
    worker = "import cloudpickle, sys; print(cloudpickle.loads(sys.stdin.buffer.read())(3))"
    done = subprocess.run([sys.executable, "-c", worker], input=cloudpickle.dumps(fn), capture_output=True,
                          cwd="/", timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == b"6"
    (tmp_path / "broken_file.py").write_text("import nowhere_to_be_found\n")
    _, problem = resolve_object("broken_file.py:f", tmp_path, {})
    assert "No module named 'nowhere_to_be_found'" in problem and "PYTHONPATH" in problem


def test_tools_and_environment_from_a_toml_are_checked_before_launch(tokenizer, tmp_path):
    from rlkit.config import ConfigError
    from rlkit.data import load_run_data

    config = write_run(tmp_path, "my_env.py:NoStep", ["my_tools.py:undocumented", "nowhere.py:f", "my_tools.py:add"])
    with pytest.raises(ConfigError) as caught:
        load_run_data(config, tokenizer)
    problems = "\n".join(caught.value.problems)
    assert 'tools[1].function="' in problems and "nowhere.py" in problems and "fix the path" in problems
    assert "tool undocumented: no JSON schema" in problems
    assert "environment NoStep needs reset(self, **fields), and step(self, text)" in problems
    config = write_run(tmp_path, "my_env.py:Counter", ["my_tools.py:add"])
    run = load_run_data(config, tokenizer)
    assert run.agent is not None and [t.name for t in run.agent.tools] == ["add"]
    assert run.agent.environment.__name__ == "Counter" and run.agent.limits.max_turns == 3
    assert "multi-turn: tools ['add'], environment Counter, at most 3 turns" in run.summary()
    prompt = run.train.next(1)[0]["prompt"]
    assert "add(a,b)" in prompt and "calculator" not in prompt, "the prompt lists the configured tools"


# -- rewards on trajectories, and what cannot travel ----------------------------------------------


def test_environment_rewards_sit_on_each_turns_last_model_token_with_turn_rewards():
    """Two turns of 2 model tokens, 2 observation tokens between them: an environment reward of 0.5 on turn 0 and
    1.0 on turn 1, a reward function's 2.0 on top. Summed at the end by default; per turn with agent.turn_rewards."""
    from rlkit.config import GRPOConfig
    from rlkit.data.batch import Batch
    from rlkit.data.trajectories import Trajectory, Turn
    from rlkit.trainer.advantages import advantage_inputs

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    turns = [Turn(index=0, start=0, end=2, text="a", observation_end=4, reward=0.5),
             Turn(index=1, start=4, end=6, text="b", observation_end=6, reward=1.0)]  # fmt: skip
    batch = Batch(
        prompts=["p"], completions=["b"], input_ids=torch.zeros(1, 9, dtype=torch.long),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0]]), response_mask=mask,
        rollout_logprobs=torch.zeros(1, 7), group=torch.zeros(1, dtype=torch.long), finish_reason=["stop"],
        trajectories=[Trajectory(messages=[], turns=turns, finish_reason="stop")],
        rewards=torch.tensor([3.5]), reward_terms={"environment": torch.tensor([1.5]), "correct": torch.tensor([2.0])},
    )  # fmt: skip
    summed = advantage_inputs(batch, GRPOConfig(group_size=1, advantage="reinforce++")).token_rewards
    assert summed.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 3.5, 0.0]]
    config = GRPOConfig(group_size=1, advantage="reinforce++", agent={"turn_rewards": True})
    per_turn = advantage_inputs(batch, config).token_rewards
    assert per_turn.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 3.0, 0.0]]
    assert batch.trajectory_lengths.tolist() == [6] and batch.response_lengths.tolist() == [4]


def test_an_environment_is_reset_on_a_row_of_the_data_before_launch(tokenizer):
    """reset needing a field the rows lack, or `environment` naming a reward function: found before launch, not as a
    run that "completes" with reward 0."""
    from rlkit.config import ConfigError, GRPOConfig
    from rlkit.data import load_run_data
    from rlkit.data.agent_tasks import answer_reward

    rows = [{"prompt": [{"role": "user", "content": "guess 1-99"}], "number": "37"}]
    config = GRPOConfig(model="tiny-agent")
    with pytest.raises(ConfigError) as caught:
        load_run_data(config, tokenizer, prompts=rows, environment=GuessNumber)
    assert "environment GuessNumber: reset(**fields) on the data's first row raised TypeError" in str(caught.value)
    assert "the rows have the fields ['number']" in str(caught.value)
    with pytest.raises(ConfigError, match="environment answer_reward: making one raised TypeError"):
        load_run_data(config, tokenizer, prompts=rows, environment=answer_reward)
    renamed = [{**rows[0], "secret": "37"}]
    run = load_run_data(config, tokenizer, prompts=renamed, environment=EchoProcess)
    assert "rewards: environment x 1" in run.summary(), "no reward model: the environment's rewards"


def batch_ending(reasons: list[str]):
    """A batch of one-turn trajectories (2 model tokens each) that ended with ``reasons``."""
    from rlkit.data.batch import Batch
    from rlkit.data.trajectories import Trajectory, Turn

    size = len(reasons)
    error = "trajectory {}, turn 0: the environment's step failed: KeyError: 'x'"
    trajectories = [
        Trajectory(messages=[], turns=[Turn(index=0, start=0, end=2, text="a")], finish_reason=reason,
                   error=error.format(i) if reason == "env_error" else "")
        for i, reason in enumerate(reasons)
    ]  # fmt: skip
    return Batch(
        prompts=["p"] * size, completions=["a"] * size, input_ids=torch.zeros(size, 4, dtype=torch.long),
        attention_mask=torch.ones(size, 4, dtype=torch.long), response_mask=torch.ones(size, 2),
        rollout_logprobs=torch.zeros(size, 2), group=torch.zeros(size, dtype=torch.long), finish_reason=reasons,
        trajectories=trajectories, advantages=torch.ones(size, 2),
    )  # fmt: skip


def test_env_errors_leave_the_loss_are_counted_and_fail_a_step_where_most_hit_them():
    """A trajectory whose environment failed is not trained on (its reward says nothing about the model) unless
    agent.keep_env_errors; the step's metrics count them; a rollout where most trajectories hit one fails loudly."""
    from rlkit.config import GRPOConfig
    from rlkit.trainer.agentic import env_error_failure, left_out_of_loss, trajectory_metrics
    from rlkit.trainer.assemble import critic_rows, policy_rows

    batch = batch_ending(["stop", "env_error", "budget", "stop"])
    rows = policy_rows(batch, left_out_of_loss(GRPOConfig()), True)
    assert rows.response_mask.sum(dim=1).tolist() == [2.0, 0.0, 2.0, 2.0]
    batch.values = batch.returns = torch.zeros(4, 2)
    assert critic_rows(batch, left_out_of_loss(GRPOConfig())).response_mask.sum(dim=1).tolist() == [2, 0, 2, 2]
    keep = GRPOConfig(agent={"keep_env_errors": True}, mask_truncated=True)
    assert policy_rows(batch, left_out_of_loss(keep), True).response_mask.sum(dim=1).tolist() == [2, 2, 0, 2]
    assert trajectory_metrics(batch)["agent/env_errors"] == 1 and env_error_failure(batch) == ""
    failure = env_error_failure(batch_ending(["env_error", "stop", "env_error", "env_error"]))
    assert failure.startswith("3 of 4 trajectories ended with env_error (their environment raised or timed out)")
    assert "trajectory 0, turn 0: the environment's step failed: KeyError: 'x'" in failure


def test_a_run_keeps_whole_trajectories_in_its_samples_and_report_and_prints_agent_figures(tokenizer, tmp_path):
    """`rlkit train`'s samples/*.jsonl hold every turn (text, calls and results, observation, reward, finish), the
    report shows each whole conversation, and the step line the agent's figures."""
    from rlkit.cli.lines import rl_lines
    from rlkit.report import _samples_html
    from rlkit.trainer.outputs import read_samples, write_samples

    out, _, _, _ = episodes(tokenizer, ["calc", "answer"])
    batch = batch_ending(out.finish_reason)
    batch.trajectories = out.trajectories
    write_samples(tmp_path, 1, batch.to_pandas())
    table = read_samples(tmp_path)[1]
    turns = table["trajectory"][0]
    assert [t["turn"] for t in turns] == [0, 1] and [t["finish"] for t in turns] == ["tool_calls", "stop"]
    assert turns[0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6*7"}, "status": "ok",
                                       "result": "42"}]  # fmt: skip
    assert turns[0]["observation"] == "42" and turns[1]["text"] == "42"
    assert [m["role"] for m in table["messages"][0]] == ["user", "assistant", "tool", "assistant"]
    page = _samples_html({1: table})
    assert "assistant: &lt;tool_call&gt;" in page and "<br>tool: 42<br>assistant: 42" in page
    lines = rl_lines(["answer", "environment"], agent=True)
    row = {"step": 3, "agent/turns/mean": 1.5, "agent/tool_use_frac": 0.25, "agent/failed_calls_frac": 0.1,
           "agent/env_errors": 2.0}  # fmt: skip
    assert "turns tools failed env_err" in " ".join(lines.header().split())
    assert "1.50  0.25   0.10       2" in lines.line(row)


def test_tools_and_environments_that_cannot_be_pickled_are_named_before_launch(tokenizer):
    from rlkit.config import GRPOConfig
    from rlkit.data.agents import collect_agent

    lock = threading.Lock()

    def locked(expression: str) -> str:
        """Hold a lock.

        Args:
            expression: anything.
        """
        with lock:
            return expression

    agent, problems = collect_agent(GRPOConfig(model="tiny-agent"), tokenizer, tools=[locked])
    assert agent is not None and len(problems) == 1
    assert problems[0].startswith("tool locked cannot be sent to the workers by value (cloudpickle: TypeError:")
    assert collect_agent(GRPOConfig(model="tiny-agent"), tokenizer) == (None, [])
