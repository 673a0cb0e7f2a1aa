"""Multi-turn rollouts on one rank, token in / token out: one batched engine call per turn over the live trajectories.

Each trajectory is a growing list of ids after its prompt (with an environment: first its opening, the first
observation that reset returned and the generation prompt, which the prompt is rendered without): the engine's
sampled ids of every model turn
(loss mask 1, with the engine's log-probs) and, between turns, the ids of the observation that answered it
(tool results or the environment's reply, rendered as a token delta by :class:`~rlkit.data.chat.ChatRenderer`;
attended to, loss mask 0). The model's tokens are never decoded and re-encoded into the sequence. A turn's
tool calls and environment steps, across all trajectories, run at once (:mod:`rlkit.rollout.actions`).
At the end every conversation is re-rendered and compared with its ids (the drift check).

The trajectory's budget is ``params.max_new_tokens`` tokens after the prompt (the batch's response width);
each finish reason is a limit of :class:`~rlkit.config.agent.AgentConfig`, see ``FINISH_REASONS`` there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.data.agents import Agent
from rlkit.data.chat import ChatRenderer, TemplateError
from rlkit.data.envs import Environment
from rlkit.data.trajectories import Trajectory, Turn
from rlkit.rollout.actions import Reaction, TurnInput, act
from rlkit.rollout.base import Generation, RolloutEngine, SamplingParams, logprob_prompts
from rlkit.rollout.calls import CallRunner
from rlkit.rollout.environments import closed, fresh, reward

logger = logging.getLogger(__name__)

TURN_SEED_STRIDE = 1_000_003
"""Turn k samples with seed ``params.seed + k * TURN_SEED_STRIDE``."""


@dataclass(frozen=True)
class EpisodeInput:
    """A prompt of a multi-turn rollout: its chat messages and its row's fields, for the environment."""

    messages: list[dict[str, Any]]
    fields: dict[str, Any]


@dataclass(kw_only=True)
class Episodes(Generation):
    """Trajectories laid out like completions ([N*n, T] after their prompts, prompt-major), plus what turns add.

    ``response_mask`` is 1 on the model's tokens only (holes where observations sit); ``logprobs`` holds the
    engine's log-probs on the model's tokens (0 elsewhere; NaN rows where some turn came back without them).
    """

    response_attention: torch.Tensor
    """[N*n, T] int64, 1 on every token after the prompt: the model's and the observations'."""
    turn_index: torch.Tensor
    """[N*n, T] int64, the model turn each token belongs to (an observation: the turn it answers); -1 on padding."""
    trajectories: list[Trajectory]
    times: dict[str, float]
    """Seconds in the engine, in tool calls and environment steps, and in rendering (deltas, drift check)."""


@dataclass(kw_only=True)
class _Open:
    """A trajectory while it runs."""

    name: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    prompt_messages: int = 0
    """How many of ``messages`` are the prompt's (those after it are the model's turns and the observations)."""
    environment: Environment | None = None
    observation: str | None = None
    """What the environment's reset returned: the first observation, or None."""
    ids: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    engine_logprobs: bool = True
    """Whether every model turn carries the engine's log-probs (asked for whole groups of trajectories)."""
    finish: str = ""
    error: str = ""
    close_error: str = ""

    def extend(self, ids: list[int], *, model: bool, turn: int, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.model += [model] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.turn_of += [turn] * len(ids)

    def end(self, reason: str) -> None:
        self.finish = reason
        if self.turns:
            self.turns[-1].finish = reason


def run_episodes(
    engine: RolloutEngine,
    renderer: ChatRenderer,
    agent: Agent,
    inputs: list[EpisodeInput],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    *,
    first_row: int = 0,
    runner: CallRunner | None = None,
) -> Episodes:
    """``params.n`` trajectories of each prompt, run to their end.

    Args:
        inputs: the N prompts' messages and fields.
        prompt_ids, prompt_mask: [N, P] the same prompts rendered (with the tools) and left-padded.
        first_row: the batch row of this rank's first trajectory (errors name trajectories by batch row).
        runner: the event loop of the tool calls and environment methods (the worker's; None: one for this call).
    """
    own = runner is None
    runner = runner or CallRunner()
    try:
        return _run(engine, renderer, agent, inputs, prompt_ids, prompt_mask, params, first_row, runner)
    finally:
        if own:
            runner.close()


def _run(
    engine: RolloutEngine,
    renderer: ChatRenderer,
    agent: Agent,
    inputs: list[EpisodeInput],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    first_row: int,
    runner: CallRunner,
) -> Episodes:
    times = {"episodes/engine": 0.0, "episodes/calls": 0.0, "episodes/render": 0.0}
    width, limits = params.max_new_tokens, agent.limits
    # 1. a trajectory per prompt and sample: its prompt's ids and messages, a fresh environment reset with its fields
    with _timed(times, "episodes/calls"):
        states = _start(agent, inputs, prompt_ids, prompt_mask, params.n, first_row, runner)
    if agent.environment is not None:
        _open(states, renderer, width)
    # whole groups of trajectories carry the engine's log-probs, at every turn (vLLM's share; HF generate: all)
    wanted = logprob_prompts(len(inputs), getattr(engine, "logprob_fraction", 1.0)).repeat_interleave(params.n)
    for state, keep in zip(states, wanted.tolist(), strict=True):
        state.engine_logprobs = keep
    smallest, shorten = _tool_result_limits(agent, renderer)
    try:
        for turn in range(limits.max_turns):
            live = [s for s in states if not s.finish]
            if not live:
                break
            # 2. one engine call over every live trajectory's whole context
            with _timed(times, "episodes/engine"):
                gen = _generate(engine, renderer.tokenizer.pad_token_id, live, params, turn, limits.max_turn_tokens,
                                prompt_ids.device)  # fmt: skip
            # 3. append each one's sampled ids (loss mask 1, engine log-probs); no end-of-turn token ends it: "length"
            for row, state in enumerate(live):
                _append_model_turn(state, gen, row, turn, width, renderer)
            acting, last = [s for s in live if not s.finish], turn == limits.max_turns - 1
            # 4. the turn's tool calls (those whose results can be shown) and environment steps, all at once
            with _timed(times, "episodes/calls"):
                inputs_ = [_turn_input(s, turn, renderer, not last and width - len(s.ids) > smallest) for s in acting]
                reactions = act(agent, inputs_, runner, shorten)
            # 5. append each reaction's ids (loss mask 0), or end: answered, env_error, max_turns, budget
            with _timed(times, "episodes/render"):
                for state, reaction in zip(acting, reactions, strict=True):
                    _append_reaction(state, reaction, renderer, turn, last=last, width=width)
    finally:
        with _timed(times, "episodes/calls"):
            _finish_environments(states, runner, limits.call_timeout)
    # 6. the drift check against each re-rendered conversation, then the tensors
    with _timed(times, "episodes/render"):
        trajectories = [_trajectory(s, renderer) for s in states]
    _log_failures(states, trajectories)
    return _pack(states, trajectories, width, renderer.tokenizer.pad_token_id, prompt_ids.device, times)


def _start(
    agent: Agent,
    inputs: list[EpisodeInput],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    n: int,
    first: int,
    runner: CallRunner,
) -> list[_Open]:
    """The open trajectories, prompt-major; each environment made and reset on the runner's loop."""
    states: list[_Open] = []
    for i, item in enumerate(inputs):
        ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
        for _ in range(n):
            row = first + len(states)
            states.append(_Open(name=f"trajectory {row}", prompt_ids=ids, messages=list(item.messages),
                                prompt_messages=len(item.messages)))  # fmt: skip
    factory = agent.environment
    if factory is None:
        return states
    fields = [item.fields for item in inputs for _ in range(n)]
    made: list[list[Environment]] = [[] for _ in fields]  # each environment as soon as it exists, to be closed
    jobs = [functools.partial(fresh, factory, f, box) for f, box in zip(fields, made, strict=True)]
    outcomes = runner.run_all(jobs, agent.limits.call_timeout)
    for state, box, outcome in zip(states, made, outcomes, strict=True):
        state.environment = box[0] if box else None
        if outcome.failed:
            state.error = f"{state.name}: the environment's reset failed: {outcome.why}"
            state.end("env_error")
        else:
            state.observation = outcome.value
    return states


def _open(states: list[_Open], renderer: ChatRenderer, width: int) -> None:
    """Open the trajectories of a run with an environment (whose prompts end without the generation prompt): the
    first observation, when reset gave one, as a user message, and the generation prompt (loss mask 0)."""
    for state in states:
        if state.finish:
            continue
        try:
            ids = renderer.opening_ids(state.prompt_ids, state.messages, state.observation)
        except TemplateError as exc:
            state.error = f"{state.name}: {exc}"
            state.end("env_error")
            continue
        if len(ids) + 1 > width:  # the opening and one model token must fit
            state.end("budget")
            continue
        state.messages += [{"role": "user", "content": state.observation}] if state.observation else []
        state.extend(ids, model=False, turn=0)


def _finish_environments(states: list[_Open], runner: CallRunner, timeout: float) -> None:
    """The ``get_reward()`` of every environment that did not fail (its value joins the last turn's reward; a
    failure ends the trajectory with env_error), then the ``close()`` of every environment made, whatever failed
    (a failure is logged and recorded as the trajectory's ``close_error``); each all at once on the runner's loop."""
    made = [(s, s.environment) for s in states if s.environment is not None]
    playing = [(s, environment) for s, environment in made if not s.error]
    asked = runner.run_all([functools.partial(reward, environment) for _, environment in playing], timeout)
    for (state, _), outcome in zip(playing, asked, strict=True):
        if outcome.failed:
            state.error = f"{state.name}: the environment's get_reward failed: {outcome.why}"
            state.end("env_error")
        elif outcome.value is not None and state.turns:
            state.turns[-1].reward += outcome.value
    closes = runner.run_all([functools.partial(closed, environment) for _, environment in made], timeout)
    for (state, _), outcome in zip(made, closes, strict=True):
        if outcome.failed:
            state.close_error = f"{state.name}: the environment's close failed: {outcome.why}"
    failed = [s.close_error for s in states if s.close_error]
    if failed:  # the episodes are over: reported, never raised over what failed first
        logger.warning("%d environment(s) failed to close:\n  %s", len(failed), "\n  ".join(failed))


def _generate(
    engine: RolloutEngine,
    pad_id: int,
    live: list[_Open],
    params: SamplingParams,
    turn: int,
    turn_cap: int,
    device: torch.device,
) -> Generation:
    """One model turn of every live trajectory: their contexts left-padded into one call on ``device``, at most what
    is left of the largest budget (and ``turn_cap`` when set) sampled."""
    contexts = [s.prompt_ids + s.ids for s in live]
    longest = max(map(len, contexts))
    ids = torch.full((len(live), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, context in enumerate(contexts):
        ids[row, longest - len(context) :] = torch.tensor(context)
        mask[row, longest - len(context) :] = 1
    room = max(params.max_new_tokens - len(s.ids) for s in live)
    cap = min(room, turn_cap) if turn_cap else room
    turn_params = dataclasses.replace(
        params, n=1, max_new_tokens=cap, min_new_tokens=min(params.min_new_tokens, cap),
        seed=params.seed + turn * TURN_SEED_STRIDE, logprob_rows=tuple(s.engine_logprobs for s in live),
    )  # fmt: skip
    return engine.generate(ids.to(device), mask.to(device), turn_params)


def _append_model_turn(state: _Open, gen: Generation, row: int, turn: int, width: int, renderer: ChatRenderer) -> None:
    """Append row ``row`` of ``gen`` (cut to what is left of the budget) as ``state``'s model turn ``turn``."""
    count = int(gen.response_mask[row].sum())
    ids = gen.response_ids[row, :count].tolist()[: width - len(state.ids)]
    stopped = bool(ids) and ids[-1] == renderer.stop_id
    state.engine_logprobs &= bool(gen.logprob_rows[row])
    start = len(state.ids)
    state.extend(ids, model=True, turn=turn, logprobs=gen.logprobs[row, : len(ids)].tolist())
    text = renderer.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
    state.turns.append(Turn(index=turn, start=start, end=len(state.ids), text=text, observation_end=len(state.ids)))
    state.messages.append({"role": "assistant", "content": text})
    if not stopped:
        state.end("length")


def _tool_result_limits(agent: Agent, renderer: ChatRenderer) -> tuple[int, Callable[[str], str]]:
    """The tokens an empty tool result takes with the next generation prompt (no room for one more: a turn's
    calls are not run), and how a tool's result is cut to ``agent.max_tool_response_tokens``."""
    limits = agent.limits
    smallest = len(renderer.observation_ids([{"role": "tool", "name": "", "content": ""}])) + 1 if agent.tools else 0
    if not limits.max_tool_response_tokens:
        return smallest, str
    return smallest, functools.partial(
        renderer.shortened, tokens=limits.max_tool_response_tokens, side=limits.tool_response_truncate_side
    )


def _turn_input(state: _Open, turn: int, renderer: ChatRenderer, can_show: bool) -> TurnInput:
    """What the calls of ``state``'s last model turn see: its text (special tokens kept: a parser may need them)
    and, for the environment, the same text without them; ``can_show``: whether tool results can still be shown."""
    last = state.turns[-1]
    model_ids = [i for i in state.ids[last.start : last.end] if i != renderer.stop_id]
    clean = renderer.tokenizer.decode(model_ids, skip_special_tokens=True)
    return TurnInput(name=f"{state.name}, turn {turn}", text=last.text, clean=clean, environment=state.environment,
                     can_show=can_show)  # fmt: skip


def _append_reaction(
    state: _Open, reaction: Reaction, renderer: ChatRenderer, turn: int, *, last: bool, width: int
) -> None:
    """Record ``reaction`` on the last turn and append its messages' ids, unless the trajectory ends here."""
    current = state.turns[-1]
    current.calls, current.reward = reaction.calls, reaction.reward
    current.observation = reaction.observation
    if reaction.error:
        state.error = reaction.error
        return state.end("env_error")
    if reaction.done:
        return state.end("stop")
    if last:
        return state.end("max_turns")
    ids = renderer.observation_ids(reaction.messages)
    if len(ids) + 1 > width - len(state.ids):  # the observation and one more model token must fit
        return state.end("budget")
    state.extend(ids, model=False, turn=turn)
    state.messages += reaction.messages
    current.observation_end = len(state.ids)
    current.finish = "tool_calls" if reaction.calls else "observation"


def _trajectory(state: _Open, renderer: ChatRenderer) -> Trajectory:
    drift = renderer.drift(state.messages, state.prompt_ids + state.ids, observations_from=state.prompt_messages)
    return Trajectory(messages=state.messages, turns=state.turns, finish_reason=state.finish, error=state.error,
                      drift=drift, close_error=state.close_error)  # fmt: skip


def _pack(
    states: list[_Open],
    trajectories: list[Trajectory],
    width: int,
    pad_id: int,
    device: torch.device,
    times: dict[str, float],
) -> Episodes:
    """The trajectories' ids, masks, log-probs and turn indices as right-padded [len(states), width] tensors."""
    shape = (len(states), width)
    ids, turn_index = torch.full(shape, pad_id, dtype=torch.long), torch.full(shape, -1, dtype=torch.long)
    mask, attention, logprobs = torch.zeros(shape), torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    for i, s in enumerate(states):
        n = len(s.ids)
        ids[i, :n], turn_index[i, :n] = torch.tensor(s.ids, dtype=torch.long), torch.tensor(s.turn_of)
        mask[i, :n], attention[i, :n] = torch.tensor(s.model, dtype=torch.float32), 1
        logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    rows = torch.tensor([s.engine_logprobs for s in states], dtype=torch.bool)
    logprobs[~rows] = float("nan")
    return Episodes(
        response_ids=ids.to(device),
        response_mask=mask.to(device),
        logprobs=logprobs.to(device),
        logprob_rows=rows.to(device),
        finish_reason=[s.finish for s in states],
        response_attention=attention.to(device),
        turn_index=turn_index.to(device),
        trajectories=trajectories,
        times=times,
    )


def _log_failures(states: list[_Open], trajectories: list[Trajectory]) -> None:
    """One log record (info: the rank's log file) naming every failed tool call and environment of this rank's
    trajectories."""
    failures = [t.error for t in trajectories if t.error]
    failures += [
        f"{s.name}, turn {turn.index}, call {j} ({c.name or 'unreadable'}): "
        f"{c.status}: {c.result.removeprefix('error: ')}"
        for s, t in zip(states, trajectories, strict=True)
        for turn in t.turns
        for j, c in enumerate(turn.calls)
        if c.status not in ("ok", "not_run")
    ]
    if failures:  # the rank's log keeps them all; the controller prints a summary per step
        logger.info("%d tool call(s) or environment(s) failed:\n  %s", len(failures), "\n  ".join(failures))


@contextmanager
def _timed(times: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    times[name] += time.perf_counter() - start
