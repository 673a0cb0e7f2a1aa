"""Bare vLLM, in-process, on a GRPO step's rollout: the yardstick rlkit's generation is held to (figures, not a test).

    python bench/bare_vllm.py --shape 0.5b [--prompts 64 --group 8 --prompt-len 64 --response-len 256]
        [--lengths varlen] [--logprobs] [--repeats 3] [--json PATH]

Same model directory, prompts (as token ids), completions per prompt, lengths, temperature (1) and batch
(``max_num_seqs`` = every completion at once) as ``bench/grpo_step.py``; no log-probs (``--logprobs``:
the sampled token's, as rlkit asks for them), no per-request seed, no detokenising, CUDA graphs on.
``bench/grpo_step.py --bare-vllm`` runs :func:`bare_generate` after rlkit's steps, in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from results import write_result
from shapes import SHAPES
from workloads import ForcedLengths, build_model_dir, digit_prompts, workload_lengths


def bare_generate(model_dir: Path, prompts: list[str], *, group: int, response_len: int, lengths: list[int] | None,
                  logprobs: bool = False, repeats: int = 3, gpu_memory_utilization: float = 0.5) -> dict[str, float]:
    """Seconds of ``repeats`` timed generate calls (after one warm-up) for ``prompts`` x ``group`` completions of
    ``response_len`` tokens each (or ``lengths``, one per completion), and the engine's start-up seconds."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process, as the brief's yardstick
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [TokensPrompt(prompt_token_ids=tokenizer(p)["input_ids"]) for p in prompts]
    longest = max(lengths) if lengths else response_len
    start = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", seed=0, max_num_seqs=len(prompts) * group,
              max_model_len=max(len(p["prompt_token_ids"]) for p in ids) + longest,
              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False, generation_config="vllm")
    start_s = time.perf_counter() - start
    if lengths:
        llm.generate = ForcedLengths(llm.generate, lengths)
    params = SamplingParams(n=group, temperature=1.0, max_tokens=response_len, min_tokens=response_len,
                            detokenize=False, logprobs=0 if logprobs else None, flat_logprobs=logprobs)
    llm.generate(ids[:2], params, use_tqdm=False)  # warm-up
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(ids, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {"generate_s": statistics.median(times), "generate_min_s": min(times), "generate_calls_s": times,
            "tokens": tokens, "tokens_per_s": tokens / statistics.median(times), "start_s": start_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, help="256; with --lengths varlen the longest, 2048")
    parser.add_argument("--lengths", choices=("fixed", "varlen"), default="fixed")
    parser.add_argument("--logprobs", action="store_true", help="return the sampled tokens' log-probs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--label", default="bare-vllm")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = workload_lengths(args, args.prompts * args.group)
    figures = bare_generate(build_model_dir(args.shape, args.root), digit_prompts(args.prompts, args.prompt_len),
                            group=args.group, response_len=args.response_len, lengths=lengths, logprobs=args.logprobs,
                            repeats=args.repeats)
    print(f"bare vLLM: {args.shape}, {args.prompts}x{args.group} completions ({args.lengths}), logprobs "
          f"{args.logprobs}: generate {figures['generate_s']:.3f} s (median of {args.repeats}), "
          f"{figures['tokens_per_s']:.0f} tokens/s, start {figures['start_s']:.1f} s")
    write_result(args.json, args.label, figures, args)


if __name__ == "__main__":
    main()
