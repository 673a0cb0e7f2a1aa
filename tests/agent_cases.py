"""A scripted rollout engine and tools for the multi-turn tests (importable on workers).

:class:`ScriptedEngine` answers each live trajectory from its context's text: the prompt's user message
names a script (``SCRIPTS``) that says what the model writes at each turn; its log-probs are a fixed
function of the position, so a test can check that every one landed where it belongs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import torch

from rlkit.data.agent_tasks import calculator
from rlkit.rollout.base import Generation, SamplingParams

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
SCRIPTS = {
    "answer": ["42"],
    "calc": [CALL.format(name="calculator", args=json.dumps({"expression": "6*7"})), "42"],
    "two_calls": [CALL.format(name="calculator", args='{"expression": "1+1"}') * 2, "2"],
    "slow": [CALL.format(name="slow", args="{}"), "done"],
    "broken": [CALL.format(name="broken", args='{"x": 1}'), "done"],
    "garbage": ["<tool_call>{nope</tool_call>", "done"],
    "unknown": [CALL.format(name="nowhere", args="{}"), "done"],
    "bad_args": [CALL.format(name="calculator", args='{"expr": "1"}'), "done"],
    "loop": [CALL.format(name="calculator", args='{"expression": "1+1"}')] * 10,
    "ramble": ["1" * 300],
    "guess": ["50", "25", "37"],
    "async_calc": [CALL.format(name="async_calculator", args=json.dumps({"expression": "6*7"})), "42"],
}
"""What the model writes at turn k of a trajectory whose prompt is the script's name (the last entry repeats)."""


def slow(seconds: float = 30.0) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "late"


def broken(x: int) -> str:
    """Fail.

    Args:
        x: anything.
    """
    raise RuntimeError(f"broken was given {x}")


async def async_calculator(expression: str) -> str:
    """Work out an expression, asynchronously.

    Args:
        expression: two whole numbers joined by +, - or *.
    """
    await asyncio.sleep(0.01)
    return calculator(expression)


class EchoProcess:
    """An async environment holding a subprocess (``cat``) from reset to close: each turn's text goes through it and
    comes back as the observation (with the process id); the third turn ends the episode."""

    async def reset(self, **fields) -> None:
        self.process = await asyncio.create_subprocess_exec(
            "cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        self.turns = 0

    async def step(self, text: str) -> tuple[str, float, bool]:
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), 5)
        self.turns += 1
        return f"echo {line.decode().strip()} from {self.process.pid}", float(self.turns), self.turns == 3

    async def close(self) -> None:
        self.process.stdin.close()
        await asyncio.wait_for(self.process.wait(), 5)


class ScriptedEngine:
    """A RolloutEngine whose model follows ``SCRIPTS``; log-prob of a token at response position t: -(t + 1) / 100.

    ``calls`` keeps each generate call's batch size and max_new_tokens.
    """

    name = "scripted"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def turn_ids(self, context: str) -> list[int]:
        """The ids the model writes next after ``context`` (its end-of-turn token included)."""
        script = next(name for name in SCRIPTS if f"user\n{name}<|im_end|>" in context)
        turn = context.count("<|im_start|>assistant") - 1
        text = SCRIPTS[script][min(turn, len(SCRIPTS[script]) - 1)]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        assert params.n == 1
        self.calls.append((len(prompt_ids), params.max_new_tokens))
        width = params.max_new_tokens
        shape = (len(prompt_ids), width)
        ids, mask = torch.full(shape, self.tokenizer.pad_token_id), torch.zeros(shape)
        reasons = []
        for row, (context, m) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            out = self.turn_ids(self.tokenizer.decode(context[m.bool()]))[:width]
            ids[row, : len(out)], mask[row, : len(out)] = torch.tensor(out), 1
            reasons.append("stop" if out[-1] == self.tokenizer.eos_token_id else "length")
        logprobs = -(torch.arange(width) + 1.0).expand(shape) / 100 * mask
        return Generation(response_ids=ids, response_mask=mask, logprobs=logprobs,
                          logprob_rows=torch.ones(len(ids), dtype=torch.bool), finish_reason=reasons)  # fmt: skip

    def load_weights(self, weights) -> int:
        return 0

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass
