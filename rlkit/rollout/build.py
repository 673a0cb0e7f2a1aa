"""Build the rollout engine a config asks for."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlkit.config import LoraConfig, RolloutConfig
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.lora import apply_lora
from rlkit.rollout.base import RolloutEngine
from rlkit.rollout.hf import HFEngine


def build_engine(
    config: RolloutConfig,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    eos_token_id: int,
    pad_token_id: int,
    max_num_seqs: int,
    max_prompt_tokens: int,
    seed: int,
    trust_remote_code: bool = False,
    adapters: LoraConfig | None = None,
) -> RolloutEngine:
    """An "hf" or "vllm" engine holding the weights in ``model_dir`` on ``device`` in ``dtype``; with
    ``config.tensor_parallel_size`` > 1 (a collective: every rank calls it), a vLLM engine per group of ranks.

    ``max_num_seqs`` is the most completions one generate call of a rank asks for (vLLM batches up to it);
    ``max_prompt_tokens`` the longest prompt (``data.max_prompt_tokens``: vLLM sizes its context for it).
    ``adapters``: the engine runs the model with these LoRA adapters and takes only their tensors in a sync (the hf
    engine's copy gets them injected; vLLM serves them as its LoRA adapter).
    """
    if config.engine == "vllm":
        from rlkit.rollout.tp_group import TPGroupEngine
        from rlkit.rollout.vllm import VLLMEngine

        tp = config.tensor_parallel_size

        def make_vllm(gpus: list[str]) -> VLLMEngine:
            return VLLMEngine(
                model_dir,
                device=device,
                dtype=dtype,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                max_num_seqs=max_num_seqs * tp,  # the whole group's completions in one call
                max_model_len=_max_model_len(max_prompt_tokens + config.max_new_tokens, model_dir),
                gpu_memory_utilization=config.engine_share,
                kv_cache_gb=config.kv_cache_gb,
                seed=seed,
                logprob_fraction=logprob_fraction(config.engine_logprobs, adapters is not None, max_num_seqs),
                sleep=config.sleep,
                trust_remote_code=trust_remote_code,
                tensor_parallel_size=tp,
                gpus=gpus,
                adapters=adapters,
            )

        return make_vllm([]) if tp == 1 else TPGroupEngine.build(tp, device, make_vllm)
    model = load_causal_lm(model_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if adapters is not None:
        apply_lora(model, adapters)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    return HFEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, tokenizer=tokenizer)


def logprob_fraction(engine_logprobs: float, adapters: bool, max_num_seqs: int) -> float:
    """The share of prompts whose completions carry vLLM's log-probs: ``rollout.engine_logprobs``, and with LoRA
    adapters at least one prompt's (the log-prob gap on it is the check that each sync reached the engine's
    adapters, so it is kept even where no other gap is asked for); ``max_num_seqs`` bounds the prompts per call."""
    return engine_logprobs if engine_logprobs > 0 or not adapters else 1 / max_num_seqs


def _max_model_len(wanted: int, model_dir: Path) -> int:
    """The prompt plus completion budget ``wanted``, capped by the model's positions (the KV cache is sized for it)."""
    with open(model_dir / "config.json") as f:
        positions = json.load(f).get("max_position_embeddings")
    return min(wanted, positions) if positions else wanted
