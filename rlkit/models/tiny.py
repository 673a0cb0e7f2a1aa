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
