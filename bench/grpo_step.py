"""GRPO steps of rlkit on a Qwen2.5-shaped model (random weights), phase by phase (figures, not a test).

    python bench/grpo_step.py --shape 0.5b --world-size 1 --engine vllm [--warmup 2 --steps 8] [--beta 0.0]
        [--micro 64] [--recompute-logprobs] [--lengths varlen] [--set fsdp.cpu_offload=true ...]
        [--bare-vllm [--breakdown-above 1.05 --breakdown-rounds 3]] [--profile] [--label NAME --json PATH]

The workload is ``bench/workloads.py``'s (GPU.md's yardstick by default; ``--lengths varlen`` is issue 15's
512 completions of 16-2,048 tokens, mean ~500, forced per completion in the vllm engine). One optimizer
step per batch; the old log-probs come from the update's own forward unless ``--recompute-logprobs``.
``--set`` overrides any config setting by its dotted name (values read as JSON, else text), e.g.
``rollout.sleep=always``, ``rollout.engine_logprobs=1``, ``fsdp.cpu_offload=true``.

``--warmup`` steps run untimed, then ``--steps`` timed ones: every phase is reported as the median and the
spread (min-max, IQR) of the timed steps (``bench/stats.py``), with tokens/s, MFU and peak memory, and the
preflight memory estimate (``rlkit.diagnostics.estimate_memory``) of each phase beside the peak measured
there (``--estimate-only``: the estimate alone). ``--bare-vllm`` builds bare vLLM in rank 0's worker, beside
rlkit's engine (``bench/engine_calls.py``), and times it on the same rollout around every step, in ABBA
order; the ratio of rlkit's generation to it is a paired ratio (median ratio and the spread of the per-step
ratios). When that ratio is above ``--breakdown-above`` (the goal, 1.05), rlkit's engine call is taken apart
in the same call (``engine_calls.breakdown``: each cause of the difference as a paired ratio; it starts a second
bare engine, in rlkit's log-prob mode, and adds 8 generate calls a round). ``--profile`` adds one profiled step
after the timed ones, never timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from pathlib import Path

import engine_calls
import pandas as pd
from profiling import start_profiler, stop_profiler
from results import write_result
from shapes import PEAK_BF16_FLOPS, SHAPES
from stats import describe, describe_ratio, paired_ratio, spread, timed
from workloads import ForcedLengths, build_model_dir, digit_prompts, random_rewards, workload_lengths

import rlkit
from rlkit import diagnostics as dx
from rlkit.diagnostics.preflight import estimate_findings

PHASES = ("step", "generate", "engine_sleep", "logprobs", "reference", "update", "sync")
"""The history's ``time/step`` and ``time/worker/<phase>`` columns this bench reports."""


def overrides(pairs: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}`` (values as JSON where they parse)."""
    out: dict = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def merged(base: dict, extra: dict) -> dict:
    return {**base, **{k: merged(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in extra.items()}}


def force_lengths(lengths: list[int]) -> int:
    """On a worker: make its vLLM engine generate this rank's share of ``lengths``, one per completion."""
    from rlkit.runtime import context

    ctx = context()
    share = len(lengths) // ctx.world_size
    mine = lengths[ctx.rank * share : (ctx.rank + 1) * share]
    for role in context().state.values():
        if hasattr(role, "engine") and hasattr(role.engine, "llm"):
            role.engine.llm.generate = ForcedLengths(role.engine.llm.generate, mine)
    return len(mine)


def engine_state() -> dict[str, object]:
    """On a worker: how its engine syncs, whether it sleeps now, and whether ``rollout.sleep="auto"`` kept it
    awake through the last update (vllm only: a sleeping engine's sync includes waking it, ~0.3 s at 0.5B on an
    H200 against ~0.04 s awake; records whose engines slept differently do not compare)."""
    from rlkit.runtime import context

    engines = [v.engine for v in context().state.values() if hasattr(v, "engine")]
    state = {k: str(getattr(e, k)) for e in engines for k in ("last_sync", "_asleep") if hasattr(e, k)}
    awake = [str(e.sleep_policy.awake_last) for e in engines if hasattr(e, "sleep_policy")]
    return state | ({"awake_through_last_update": ",".join(awake)} if awake else {})


def device_memory_gib() -> float:
    """On a worker: its device's memory in GiB (NaN on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def memory_estimate(config: rlkit.GRPOConfig, args, device_gib: float) -> dx.MemoryEstimate:
    """The preflight estimate of this run from the shape's config (fixed lengths pad nothing: no mask)."""
    host_gib = args.host_memory_gib or dx.host_memory()[1]
    setting = dx.memory_setting(config, world_size=args.world_size, device_memory_gib=device_gib,
                                host_memory_gib=host_gib)
    if args.lengths == "fixed":
        setting = dataclasses.replace(setting, padding_mask=False)
    return dx.estimate_memory({"model_type": "qwen2", **SHAPES[args.shape]}, setting)


def summarize(history: pd.DataFrame, n_params: int, config: rlkit.GRPOConfig, args, peak_gib: float) -> dict:
    """Medians and spreads of every phase over the timed steps, and the throughput figures from the medians."""
    h = history.iloc[args.warmup:] if len(history) > args.warmup else history
    column = {p: "time/step" if p == "step" else f"time/worker/{p}" for p in PHASES}
    phases = {p: spread(h[c].tolist()) for p, c in column.items() if c in h}
    median = lambda p: phases[p]["median"] if p in phases else 0.0  # noqa: E731
    samples = config.samples_per_step
    response = float(h["response/length/mean"].median())
    tokens = samples * (args.prompt_len + response)  # real tokens per step (no padding)
    step, update, generate = median("step"), median("update"), median("generate")
    forwards = int(config.recompute_logprobs) + int(config.kl_coef > 0)  # old log-probs, reference
    flops = tokens * n_params * (6 + 2 * forwards)  # train (fwd+bwd) + scoring forwards; generation excluded
    workers = sum(median(p) for p in PHASES[1:])
    return {
        "phases": phases,
        **{f"{p}_s": median(p) for p in PHASES},
        "controller_overhead_s": step - workers - float(h["time/score"].median() + h["time/advantages"].median()),
        "response_len_mean": response,
        "rollout_tokens_per_s": samples * response / max(generate, 1e-9),
        "update_tokens_per_s": tokens / max(update, 1e-9),
        "mfu_update": 6 * n_params * tokens / max(update, 1e-9) / (PEAK_BF16_FLOPS * args.world_size),
        "mfu_step": flops / step / (PEAK_BF16_FLOPS * args.world_size),
        "peak_gib_max_rank": peak_gib,
        "reward_mean": float(h["reward/mean"].median()),
        "logprob_gap_mean": float(h["rollout/logprob_gap/mean"].median()) if "rollout/logprob_gap/mean" in h else None,
        "steps_s": [float(x) for x in history["time/step"]],
        "warmup": args.warmup,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="vllm")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, help="256; with --lengths varlen the longest, 2048")
    parser.add_argument("--lengths", choices=("fixed", "varlen"), default="fixed")
    parser.add_argument("--micro", type=int, default=64, help="sequences per forward/backward")
    parser.add_argument("--recompute-logprobs", action="store_true", help="score rollouts in a separate pass")
    parser.add_argument("--beta", type=float, default=0.0, help="kl_coef (0: no reference model)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config setting")
    parser.add_argument("--bare-vllm", action="store_true", help="alternate bare vLLM on the same rollout")
    parser.add_argument("--bare-memory", type=float, default=0.15, help="bare vLLM's gpu_memory_utilization")
    parser.add_argument("--breakdown-above", type=float, default=1.05, help="take the engine call apart above this")
    parser.add_argument("--breakdown-rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--profile", action="store_true", help="one more step, profiled, not timed")
    parser.add_argument("--estimate-only", action="store_true", help="print the memory estimate and stop")
    parser.add_argument("--device-memory-gib", type=float,
                        help="with --estimate-only: the device's memory (default: the card nvidia-smi lists)")
    parser.add_argument("--host-memory-gib", type=float, default=0.0,
                        help="with --estimate-only: the host's memory, for the offload check (0: this machine's)")
    parser.add_argument("--label", default="rlkit")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.lengths == "varlen" and args.engine != "vllm":
        parser.error("--lengths varlen forces lengths through vLLM: use --engine vllm")
    if args.bare_vllm and args.engine != "vllm":
        parser.error("--bare-vllm compares against rlkit's vLLM engine: use --engine vllm")
    return args


def run_config(args, model: str) -> rlkit.GRPOConfig:
    fixed = args.lengths == "fixed"
    base = {
        "model": model, "seed": 0, "steps": args.warmup + args.steps + int(args.profile),
        "prompts_per_step": args.prompts, "group_size": args.group, "kl_coef": args.beta,
        "micro_batch_size": args.micro, "recompute_logprobs": args.recompute_logprobs, "optim": {"lr": 1e-6},
        "rollout": {"engine": args.engine, "max_new_tokens": args.response_len,
                    "min_new_tokens": args.response_len if fixed else 0},
        "data": {"max_prompt_tokens": args.prompt_len},
    }
    return rlkit.GRPOConfig.from_dict(merged(base, overrides(args.set)))


def run_steps(cluster, trainer, args) -> list[dict[str, float]]:
    """warmup + steps trainer steps; with --bare-vllm one bare call beside each, before it or after it in ABBA
    order (so drift in either direction cancels). Returns the bare calls."""
    bare = []
    for i in range(args.warmup + args.steps):
        first = args.bare_vllm and i % 4 in (1, 2)
        if first:
            bare.append(cluster.run(engine_calls.bare_call)[0])
        trainer.step()
        if args.bare_vllm and not first:
            bare.append(cluster.run(engine_calls.bare_call)[0])
    return bare


def compare_with_bare(figures: dict, history: pd.DataFrame, bare_calls: list[dict], cluster, args) -> None:
    """Bare vLLM's spread, rlkit's generation over it (paired by step), and the breakdown when it is above the
    threshold (this process holds both engines still)."""
    ours = timed(history["time/worker/generate"].tolist(), args.warmup)
    theirs = timed([c["s"] for c in bare_calls], args.warmup)
    figures["bare_vllm"] = {"generate": spread(theirs), "generate_s": spread(theirs)["median"], "calls": bare_calls}
    figures["generate_over_bare"] = paired_ratio(ours, theirs)
    figures["engine_settings_differ"] = cluster.run(engine_calls.settings)[0]
    if figures["generate_over_bare"]["ratio_of_medians"] > args.breakdown_above:
        figures["breakdown"] = cluster.run(engine_calls.breakdown, args.breakdown_rounds)[0]


def main() -> None:
    args = parse_args()
    lengths = workload_lengths(args, args.prompts * args.group)
    if args.estimate_only:
        args.device_memory_gib = args.device_memory_gib or dx.visible_gpu_memory_gib()
        if args.device_memory_gib is None:
            raise SystemExit("--estimate-only: no GPU visible (nvidia-smi); give the device's --device-memory-gib")
        shape = {"model_type": "qwen2", **SHAPES[args.shape]}
        try:
            plan = dx.plan_run(run_config(args, "tiny"), shape, world_size=args.world_size, device="cuda",
                               device_memory_gib=args.device_memory_gib,
                               host_memory_gib=args.host_memory_gib or dx.host_memory()[1])  # fmt: skip
        except rlkit.ConfigError as err:
            raise SystemExit(f"--estimate-only: {err}") from None
        estimate = memory_estimate(plan.config, args, args.device_memory_gib)
        print(plan.line, estimate, estimate_findings(estimate), sep="\n")
        return
    model_dir = build_model_dir(args.shape, args.root)
    prompts = digit_prompts(args.prompts * 4, args.prompt_len)
    config = run_config(args, str(model_dir))
    profile = None
    with rlkit.launch(world_size=args.world_size, device=args.device) as cluster:
        trainer = rlkit.Trainer(cluster, config, reward_fn=random_rewards, prompts=prompts)
        config = trainer.config  # the memory plan's: what the run measures
        if lengths:
            cluster.run(force_lengths, lengths)
        if args.bare_vllm:
            bare_start = cluster.run(engine_calls.start_bare, str(model_dir), prompts[: args.prompts], args.group,
                                     args.response_len, lengths, args.bare_memory)[0]
        bare_calls = run_steps(cluster, trainer, args)
        history = trainer.history
        # the last step's peak: each memory mark's peak_mb covers its phase (the history's peak columns are
        # read just after a mark resets the peak, so they hold what stays allocated, not the peak)
        marks = trainer.memory()
        peak_gib = float(marks["peak_mb"].max()) / 1024
        device_gib = cluster.run(device_memory_gib)[0]
        args.device_memory_gib = device_gib if math.isfinite(device_gib) else None  # the record holds the card's
        n_params = _param_count(model_dir)
        figures = {**summarize(history, n_params, config, args, peak_gib), "n_params": n_params,
                   "engine_state": cluster.run(engine_state)[0], "config": config.to_dict(),
                   "memory_plan": trainer.plan.line}
        if args.bare_vllm:
            figures["bare_start"] = bare_start
            compare_with_bare(figures, history, bare_calls, cluster, args)
            cluster.run(engine_calls.stop_bare)
        if args.profile:
            cluster.run(start_profiler)
            trainer.step()
            profile = cluster.run(stop_profiler, 25)[0]
            figures["profile"] = profile
    if math.isfinite(device_gib):
        estimate = memory_estimate(config, args, device_gib)
        figures["memory_estimate"] = estimate.to_pandas().round(3).to_dict()
        figures["estimate_vs_measured"] = estimate.compare_marks(marks).to_dict("records")
    report(figures, n_params, args, profile)
    write_result(args.json, args.label, figures, args)


def report(figures: dict, n_params: int, args, profile: dict[str, str] | None) -> None:
    print(f"rlkit GRPO step: {args.shape} ({n_params / 1e6:.0f}M), {args.world_size} rank(s), engine {args.engine}, "
          f"{args.prompts}x{args.group} completions ({args.lengths}, up to {args.response_len} tokens), "
          f"beta {args.beta}, micro-batch {args.micro}, settings {args.set}, {args.warmup} warm-up + "
          f"{args.steps} timed steps")
    for phase, s in figures["phases"].items():
        print(f"  {phase:<24}{describe(s)}")
    for key, value in figures.items():
        if isinstance(value, float) and not key.endswith("_s"):
            print(f"  {key:<24}{value:>12.4g}")
    print(f"  engine                  {figures['engine_state']}")
    print(f"  {figures['memory_plan']}")
    if "bare_vllm" in figures:
        print(f"  bare vLLM generate      {describe(figures['bare_vllm']['generate'])}")
        print(f"  rlkit / bare (generate) {describe_ratio(figures['generate_over_bare'])}")
        print(f"  engine settings that differ: {figures['engine_settings_differ']}")
        parts = figures.get("breakdown", {})
        for variant, s in parts.get("variants", {}).items():
            print(f"  breakdown {variant:<17}{describe(s['s'])}; vLLM CPU {describe(s['vllm_cpu_s'])}; "
                  f"worker CPU {describe(s['worker_cpu_s'])}")
        for cause, ratio in parts.get("causes", {}).items():
            print(f"  cause: {cause:<46}{describe_ratio(ratio)}")
        for problem in parts.get("problems", []):
            print(f"  breakdown: {problem}")
    if "estimate_vs_measured" in figures:
        print("  memory estimate (GiB per rank) against the last step's measured peaks:")
        print(pd.DataFrame(figures["memory_estimate"]).to_string())
        print(pd.DataFrame(figures["estimate_vs_measured"]).to_string(index=False))
    if profile:
        print("profile of one step, rank 0 (top operators by self device time):")
        print(profile["ops"])
        print("the same by input shapes:")
        print(profile["shapes"])


def _param_count(model_dir: Path) -> int:
    """Parameters in the model directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


if __name__ == "__main__":
    main()
