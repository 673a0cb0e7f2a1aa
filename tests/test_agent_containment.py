"""A user's own tools and environment cannot break a rollout: every environment is closed exactly once whatever
failed, a failing close is reported (never raised over the first error), and whatever a tool raises or returns
(BaseExceptions, its own TimeoutError, None, a result that cannot be printed) is that call's outcome, named."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from agent_cases import episodes

from rlkit.data.agent_tasks import GuessNumber, calculator
from rlkit.data.envs import reset_problems
from rlkit.models import load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR
from rlkit.rollout.calls import GRACE, CallRunner, call
from rlkit.trainer.agentic import failure_summary


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_AGENT_DIR)


def bounded(fn, *args, seconds: float = 20.0, **kwargs):
    """``fn(*args, **kwargs)`` on a daemon thread, failing the test (not hanging it) when it does not return within
    ``seconds``; what it raises is raised here."""
    done: list = []

    def run() -> None:
        try:
            done.append((fn(*args, **kwargs), None))
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            done.append((None, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    value, error = done[0]
    if error is not None:
        raise error
    return value


# -- every environment closed exactly once -------------------------------------------------------


class Ledger(GuessNumber):
    """GuessNumber that counts its closes; ``fail`` names the method that fails (or hangs past the timeout)."""

    made: list[Ledger] = []
    fail = ""

    def __init__(self) -> None:
        self.closes = 0
        Ledger.made.append(self)

    def reset(self, **fields):
        if self.fail == "reset":
            raise KeyError("secret")
        if self.fail == "reset_hangs":
            time.sleep(1.0)
        super().reset(**fields)
        return ("gym-style", {}) if self.fail == "reset_tuple" else None

    def step(self, text: str):
        if self.fail == "step":
            raise ValueError("the board fell over")
        return super().step(text)

    async def get_reward(self) -> float:
        if self.fail == "get_reward":
            raise RuntimeError("no score")
        if self.fail == "get_reward_hangs":
            await asyncio.sleep(30)
        if self.fail == "get_reward_text":
            return "high"  # type: ignore[return-value]
        return 0.5

    def close(self) -> None:
        self.closes += 1
        if self.fail == "close":
            raise OSError("the sandbox is already gone")


FAILURES = {
    "": ("stop", ""),
    "reset": ("env_error", "the environment's reset failed: KeyError('secret')"),
    "reset_tuple": ("env_error", "reset returned ('gym-style', {}) (tuple)"),
    "reset_hangs": ("env_error", "the environment's reset failed: timed out after 0.4 s"),
    "step": ("env_error", "the environment's step failed: ValueError: the board fell over"),
    "get_reward": ("env_error", "the environment's get_reward failed: RuntimeError('no score')"),
    "get_reward_hangs": ("env_error", "the environment's get_reward failed: timed out after 0.4 s"),
    "get_reward_text": ("env_error", "get_reward returned 'high' (str): return a finite number, or None"),
}


@pytest.mark.parametrize("fail", list(FAILURES))
def test_every_environment_is_closed_exactly_once_whatever_failed(tokenizer, fail):
    Ledger.made = []
    environment = type(f"Ledger_{fail}", (Ledger,), {"fail": fail})
    out, _, _, _ = episodes(tokenizer, ["guess", "guess"], tools=(), environment=environment, call_timeout=0.4)
    finish, error = FAILURES[fail]
    assert out.finish_reason == [finish, finish]
    assert all(error in t.error for t in out.trajectories), [t.error for t in out.trajectories]
    assert [e.closes for e in Ledger.made] == [1, 1], "each environment made is closed once"
    assert all(t.close_error == "" for t in out.trajectories)
    if not fail:
        assert [t.env_reward for t in out.trajectories] == [1.5, 1.5], "get_reward joins the last turn's reward"


def test_a_failing_close_is_logged_and_recorded_never_raised(tokenizer, caplog):
    """close raising after a good episode, and after a failed step: the episode keeps its outcome and first error;
    the close error is on the trajectory, in the log and in the step's summary."""
    Ledger.made = []
    fine = type("FineButClose", (Ledger,), {"fail": "close"})
    with caplog.at_level("WARNING", logger="rlkit.rollout.episodes"):
        out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=fine)
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["stop"] and trajectory.error == "" and trajectory.env_reward == 1.5
    assert trajectory.close_error == (
        "trajectory 10: the environment's close failed: OSError('the sandbox is already gone')"
    )
    assert "1 environment(s) failed to close:\n  trajectory 10: the environment's close failed" in caplog.text
    assert trajectory.records()[-1]["close_error"] == trajectory.close_error
    batch = type("Steps", (), {"trajectories": out.trajectories})()
    assert failure_summary(batch) == (
        "1 of 1 environments failed to close: details in the rank logs and batch.turns_frame()"
    )

    class BothFail(Ledger):
        fail = "close"

        def step(self, text: str):
            raise ValueError("the board fell over")

    out, _, _, _ = episodes(tokenizer, ["guess"], tools=(), environment=BothFail)
    trajectory = out.trajectories[0]
    assert out.finish_reason == ["env_error"] and "step failed: ValueError: the board fell over" in trajectory.error
    assert "close failed: OSError" in trajectory.close_error and [e.closes for e in Ledger.made] == [1, 1]


def test_the_reset_preflight_closes_after_a_failed_reset_and_reports_a_failing_close():
    Ledger.made = []
    broken = type("BrokenReset", (Ledger,), {"fail": "reset"})
    problems = reset_problems(broken, {"secret": "37"}, timeout=5)
    assert len(problems) == 1 and "reset(**fields) on the data's first row raised KeyError" in problems[0]
    gym = type("GymReset", (Ledger,), {"fail": "reset_tuple"})
    assert "return the first observation as a str" in reset_problems(gym, {"secret": "37"}, timeout=5)[0]
    assert [e.closes for e in Ledger.made] == [1, 1]

    class ResetAndCloseFail(Ledger):
        fail = "close"

        def reset(self, **fields):
            raise KeyError("secret")

    problems = reset_problems(ResetAndCloseFail, {"secret": "37"}, timeout=5)
    assert [p.split(": ")[1] for p in problems] == [
        "reset(**fields) on the data's first row raised KeyError",
        "close() after a reset on the data's first row raised OSError",
    ], "the reset's problem first, then the close's"
    closing = type("CloseFails", (Ledger,), {"fail": "close"})
    problems = reset_problems(closing, {"secret": "1"}, timeout=5)
    assert len(problems) == 1 and "close() after a reset on the data's first row raised OSError" in problems[0]


# -- whatever a tool raises is that call's error -----------------------------------------------------


def raising(kind: str):
    """The exception of ``kind`` that a tool raises."""
    return {
        "exit": SystemExit(3),
        "interrupt": KeyboardInterrupt(),
        "generator": GeneratorExit("closed"),
        "cancelled": asyncio.CancelledError("its own"),
        "timeout": TimeoutError("the backend did not answer"),
    }[kind]


KINDS = ["exit", "interrupt", "generator", "cancelled", "timeout"]


def test_base_exceptions_of_tools_are_their_calls_errors_and_the_loop_lives_on():
    """Async and sync tools raising SystemExit, KeyboardInterrupt, GeneratorExit, CancelledError and their own
    TimeoutError at once, beside a good call: each is its call's error (the exception itself, not "timed out"),
    the good call returns, and the loop runs the next batch."""

    async def async_raiser(kind: str):
        raise raising(kind)

    def sync_raiser(kind: str):
        raise raising(kind)

    jobs = [lambda f=f, k=k: call(f, k) for f in (async_raiser, sync_raiser) for k in KINDS]
    runner = CallRunner()
    try:
        outcomes = bounded(runner.run_all, [*jobs, lambda: call(calculator, "6*7")], timeout=5.0)
        again = bounded(runner.run_all, [lambda: call(calculator, "1+1")], timeout=5.0)
    finally:
        runner.close()
    expected = [SystemExit, KeyboardInterrupt, GeneratorExit, asyncio.CancelledError, TimeoutError] * 2
    assert [type(o.error) for o in outcomes[:-1]] == expected
    assert not any(o.timed_out for o in outcomes) and outcomes[-1].value == "42" and again[0].value == "2"


def test_a_call_that_ignores_its_cancellation_is_abandoned_as_timed_out():
    async def stubborn():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(10)  # ignores the timeout's cancellation
        return "late"

    runner = CallRunner()
    start = time.perf_counter()
    try:
        outcomes = bounded(runner.run_all, [lambda: call(stubborn), lambda: call(calculator, "2*3")], timeout=0.3)
    finally:
        runner.close()
    assert outcomes[0].timed_out and outcomes[0].seconds == 0.3 and outcomes[1].value == "6"
    assert time.perf_counter() - start < 0.3 + GRACE + 2


async def escaping(kind: str) -> str:
    """Raise what ``kind`` names.

    Args:
        kind: exit, interrupt, generator, cancelled or timeout.
    """
    raise raising(kind)


def forgetful(x: int) -> None:
    """Do something and forget to return it.

    Args:
        x: anything.
    """


class Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text for you")


def unprintable(x: int) -> Unprintable:
    """Return what cannot be shown.

    Args:
        x: anything.
    """
    return Unprintable()


def test_what_tools_raise_or_return_is_named_in_their_call_and_the_rollout_goes_on(tokenizer, caplog):
    """In a rollout: BaseExceptions and a tool's own TimeoutError are "error" calls naming the exception; None is an
    empty result with one warning naming the tool; a result whose str() raises is that call's error, naming it."""
    tools = (escaping, forgetful, unprintable)
    with caplog.at_level("WARNING", logger="rlkit.rollout.actions"):
        out, _, _, _ = bounded(episodes, tokenizer, ["escapes", "returns"], tools=tools, width=800)
    escapes, returns = ([(c.status, c.result) for c in t.turns[0].calls] for t in out.trajectories)
    assert escapes == [
        ("error", "error: escaping raised SystemExit: 3"),
        ("error", "error: escaping raised KeyboardInterrupt: "),
        ("error", "error: escaping raised GeneratorExit: closed"),
        ("error", "error: escaping raised CancelledError: its own"),
        ("error", "error: escaping raised TimeoutError: the backend did not answer"),
    ]
    assert returns == [("ok", ""), ("ok", ""), ("error", "error: unprintable returned a Unprintable whose str() raised "
                                                          "ValueError: no text for you; return a str")]  # fmt: skip
    assert out.finish_reason == ["stop", "stop"]
    warnings = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert warnings == ['tool forgetful returned None: the model reads an empty result; if it should return '
                        'something, add the missing `return` (return "" to silence this)']  # fmt: skip

