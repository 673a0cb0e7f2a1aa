"""The benchmark workloads every GPU bench shares (rlkit, bare vLLM, TRL, verl): model, prompts, lengths, rewards.

GPU.md's yardstick: a Qwen2.5-shaped model with random weights (``SHAPES``), ``prompts`` prompts of exactly
``prompt_len`` digit tokens, ``group`` completions each of exactly ``response_len`` tokens (end-of-text
suppressed), temperature 1, random rewards. Issue 15's variable-length workload ("varlen") draws each
completion's exact length from a fixed seeded distribution instead, forced per request in vLLM
(``min_tokens = max_tokens = length``) by :class:`ForcedLengths`.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

from shapes import SHAPES

VARLEN = dict(low=16, high=2048, mean=500, sigma=1.0, seed=0)
"""Issue 15's lengths: log-normal (sigma 1) clipped to [16, 2048], its median set so the clipped mean is ~500."""


def build_model_dir(shape: str, root: Path) -> Path:
    """A model directory with random fp32 weights of ``shape`` and the bundled tokenizer (digits are one token
    each). Weights are N(0, 0.02) (norms 1), as transformers initialises them, filled directly on the GPU where
    there is one (a 7B folder in seconds, not minutes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit.models.tiny import TINY_MODEL_DIR

    out = root / f"qwen2-{shape}-random"
    if (out / "config.json").is_file():
        return out
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    partial = out.with_name(out.name + ".partial")  # a build stopped midway leaves no folder that looks complete
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY_MODEL_DIR / name, partial / name)
    partial.rename(out)
    return out


def digit_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``length`` random digits (one token each with the bundled tokenizer)."""
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(length)) for _ in range(count)]


def random_rewards(prompts, completions, **fields):
    rng = random.Random(len(completions) + sum(map(len, completions)))
    return [rng.random() for _ in completions]


def varlen_lengths(count: int, low: int = 16, high: int = 2048, mean: float = 500, sigma: float = 1.0,
                   seed: int = 0) -> list[int]:
    """``count`` completion lengths in [low, high], log-normal, their clipped mean within 1% of ``mean``."""
    rng = random.Random(seed)
    normals = [rng.gauss(0.0, sigma) for _ in range(count)]
    scale = mean / math.exp(sigma**2 / 2)
    for _ in range(30):  # the clipping moves the mean: rescale the median until it lands
        lengths = [min(high, max(low, round(scale * math.exp(z)))) for z in normals]
        got = sum(lengths) / count
        if abs(got - mean) <= 0.01 * mean:
            break
        scale *= mean / got
    return lengths


def workload_lengths(args, count: int) -> list[int] | None:
    """Settle ``args.response_len`` (None: 256 fixed, 2,048 varlen) and, for ``args.lengths == "varlen"``, draw
    ``count`` lengths; a smaller ``--response-len`` scales the distribution down (for dry runs on a CPU)."""
    longest = VARLEN["high"] if args.lengths == "varlen" else 256
    args.response_len = args.response_len or longest
    if args.lengths != "varlen":
        return None
    scale = args.response_len / VARLEN["high"]
    return varlen_lengths(count, low=min(VARLEN["low"], args.response_len), high=args.response_len,
                          mean=VARLEN["mean"] * scale, sigma=VARLEN["sigma"], seed=VARLEN["seed"])


class ForcedLengths:
    """Wraps ``vllm.LLM.generate`` so that the k-th completion it is asked for has exactly ``lengths[k % len]``
    tokens (each request of n samples becomes n requests of one, ``min_tokens = max_tokens = length``);
    outputs come back grouped as the caller asked, sample i at ``outputs[i]`` with ``index`` i."""

    def __init__(self, generate, lengths: list[int]):
        self.generate, self.lengths, self.calls = generate, lengths, 0

    def __call__(self, prompts, sampling_params=None, **kwargs):
        if not isinstance(prompts, list):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        flat_prompts, flat_params, k = [], [], 0
        for prompt, sp in zip(prompts, params, strict=True):
            for _ in range(sp.n):
                length = self.lengths[k % len(self.lengths)]
                one = sp.clone()
                one.n, one.max_tokens, one.min_tokens = 1, length, length
                flat_prompts.append(prompt)
                flat_params.append(one)
                k += 1
        outputs = self.generate(flat_prompts, flat_params, **kwargs)
        grouped, start = [], 0
        for sp in params:
            first = outputs[start]
            first.outputs = [outputs[start + i].outputs[0] for i in range(sp.n)]
            for i, c in enumerate(first.outputs):
                c.index = i
            grouped.append(first)
            start += sp.n
        self.calls += 1
        return grouped
