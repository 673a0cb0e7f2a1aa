"""The bundled tiny policy: a 2-layer Qwen2 (329k parameters, fp32) and its byte-level BPE tokenizer.

It was trained for `rlkit.data.tasks.AdditionTask` ("17+25=" -> "42" then
``<|endoftext|>``) by noisy-label SFT, so it knows the rule but samples the
right answer only about 30% of the time at temperature 1 (greedy decoding is
about 90% right): GRPO can raise the mean reward above 0.8 in a few dozen steps.
Rebuild it (deterministic for a given seed, a few minutes on 2 CPU cores) with

    python scripts/build_tiny.py --out rlkit/models/tiny --seed 0
"""

from pathlib import Path

TINY_MODEL_DIR: Path = Path(__file__).resolve().parent / "tiny"
"""Hugging Face model folder (config, generation config, safetensors, tokenizer) of the bundled tiny policy."""
TINY_AGENT_DIR: Path = Path(__file__).resolve().parent / "tiny_agent"
"""The bundled tiny agent (``model="tiny-agent"``): a 3-layer Qwen2 with a chat template that lists tools, pre-trained
on the multi-turn tasks of :mod:`rlkit.data.agent_tasks` (products, dates and unit conversions, with one, two or all
three of its tools listed, in any order: it calls the listed tool that the prompt needs in the Hermes format on a
fifth to a third of the prompts, a tool not listed nearly never, and guesses the others; guess-the-number by noisy
bisection). Rebuild it with

    python scripts/build_tiny_agent.py --out rlkit/models/tiny_agent --seed 0
"""
BUNDLED_MODELS: dict[str, Path] = {"tiny": TINY_MODEL_DIR, "tiny-agent": TINY_AGENT_DIR}
"""The model names that need no directory: the bundled models' folders."""
