"""rlkit's policy update alone, its levers against each other in one process on one batch (figures, not a test).

    python bench/update_levers.py --shape 0.5b [--warmup 1 --steps 8] [--variants reshard+eager keep+fused ...]
        [--profile keep+fused] [--set fsdp.kernels=liger ...] [--label NAME --json PATH]

One rollout of the yardstick's workload (``bench/workloads.py``: 64 prompts x 8 completions of exactly 256
tokens, the hf engine, no vLLM needed), then ``PolicyWorker.update`` on that same batch again and again, one
optimizer step each, the variants taking turns in an order that rotates every round (``--warmup`` rounds
untimed). A variant is ``<fsdp>+<head>[+micro<N>]``:

- ``reshard``: FSDP gathers and reduces every micro-batch; ``keep``: units kept gathered, gradients unsharded
  through the step (rlkit.fsdp.accumulate; the default where the memory estimate says it fits);
- ``eager``: the fused head's chunk math run eagerly; ``fused``: compiled (the default on a GPU);
- ``micro<N>``: N sequences per micro-batch (default ``--micro``, 64); variants the memory estimate says will
  not fit are skipped.

Prints each variant's update seconds (median and spread), tokens/s, MFU and peak memory, and its paired ratio
(round by round) to the first variant; ``--profile`` adds one profiled update of that variant (top operators,
and by input shapes). The weight sync is not part of the update's seconds (it is reported apart). ``--set``
overrides a config setting for every variant, as in grpo_step.py: what is fixed when the model is built
(``fsdp.compile``, ``fsdp.kernels``: Liger's kernels patch the worker's transformers modules for good) is
compared across runs, one process each.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from grpo_step import _param_count, merged, overrides
from profiling import start_profiler, stop_profiler
from results import write_result
from shapes import PEAK_BF16_FLOPS, SHAPES
from stats import describe, describe_ratio, paired_ratio, spread, timed
from workloads import build_model_dir, digit_prompts, random_rewards

import rlkit
from rlkit import diagnostics as dx

VARIANTS = ("reshard+eager", "keep+eager", "reshard+fused", "keep+fused", "keep+fused+micro128",
            "keep+fused+micro256")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    keep: bool
    head: str
    micro: int

    @classmethod
    def parse(cls, name: str, micro: int) -> Variant:
        fsdp, head, *rest = name.split("+")
        if fsdp not in ("keep", "reshard") or head not in ("eager", "fused") or any(
                not r.startswith("micro") for r in rest):
            raise ValueError(f"{name!r}: use <keep|reshard>+<eager|fused>[+micro<N>]")
        return cls(name, fsdp == "keep", head, int(rest[0].removeprefix("micro")) if rest else micro)


def set_variant(keep: bool, head: str, micro: int) -> str:
    """On the worker: the policy's FSDP accumulation, chunk math and micro-batch size for the next updates; returns
    the chunk math's name (with its compile failure, if it fell back)."""
    import torch

    from rlkit.models.head import EAGER, fused_chunk_math, response_head
    from rlkit.runtime import context

    state = context().state
    role = next(v for v in state.values() if hasattr(v, "actor") and hasattr(v, "engine"))
    role.actor.keep_unsharded = keep
    role.config = dataclasses.replace(role.config, micro_batch_size=micro)
    head_module = response_head(role.actor.model)
    if head_module is not None:
        fused = state.setdefault("bench.fused", fused_chunk_math())  # one compiled instance for every round
        head_module.use_chunk_math(EAGER if head == "eager" else fused)
        failure = getattr(fused.stats, "failure", None) or getattr(fused.grad, "failure", None)
        if head == "fused" and failure:
            return f"fused (fell back: {failure})"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return head


def timed_update(rows) -> dict[str, float]:
    """On the worker: one ``PolicyWorker.update`` on ``rows``; its phase seconds and the peak memory (GiB)."""
    import torch

    from rlkit.runtime import context

    role = next(v for v in context().state.values() if hasattr(v, "actor") and hasattr(v, "engine"))
    result = role.update(rows)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {**result.times, "peak_gib": peak}


def fits(variant: Variant, config: rlkit.GRPOConfig, args) -> bool:
    """Whether the memory estimate says the variant's update fits the device (``--device-memory-gib``, else the card
    nvidia-smi lists; always without a GPU)."""
    device_gib = args.device_memory_gib or dx.visible_gpu_memory_gib()
    if device_gib is None:
        return True
    cfg = dataclasses.replace(config, micro_batch_size=variant.micro)
    setting = dx.memory_setting(cfg, world_size=1, device_memory_gib=device_gib)
    setting = dataclasses.replace(setting, padding_mask=False, keep_unsharded=variant.keep)
    return dx.estimate_memory({"model_type": "qwen2", **SHAPES[args.shape]}, setting).fits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (the fused math compiles in the first)")
    parser.add_argument("--steps", type=int, default=8, help="timed rounds")
    parser.add_argument("--profile", metavar="VARIANT", help="one more update of this variant, profiled")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--device-memory-gib", type=float,
                        help="skip variants the estimate says will not fit this much (default: the card's)")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config setting")
    parser.add_argument("--label", default="rlkit-update")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model_dir = build_model_dir(args.shape, args.root)
    config = rlkit.GRPOConfig.from_dict(merged({
        "model": str(model_dir), "seed": 0, "prompts_per_step": args.prompts, "group_size": args.group,
        "micro_batch_size": args.micro, "optim": {"lr": 1e-6}, "steps": 1000,
        "rollout": {"engine": "hf", "max_new_tokens": args.response_len, "min_new_tokens": args.response_len},
        "data": {"max_prompt_tokens": args.prompt_len}}, overrides(args.set)))
    variants = [Variant.parse(v, args.micro) for v in args.variants]
    skipped = [v.name for v in variants if not fits(v, config, args)]
    variants = [v for v in variants if v.name not in skipped]
    from rlkit.trainer.assemble import policy_rows

    with rlkit.launch(world_size=1, device=args.device) as cluster:
        trainer = rlkit.Trainer(cluster, config, reward_fn=random_rewards,
                                prompts=digit_prompts(args.prompts, args.prompt_len))
        batch = trainer.advantages(trainer.score(trainer.rollout()))
        rows = policy_rows(batch)
        calls: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
        heads: dict[str, str] = {}
        for r in range(args.warmup + args.steps):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                heads[v.name] = cluster.run(set_variant, v.keep, v.head, v.micro)[0]
                calls[v.name].append(cluster.run(timed_update, rows)[0])
        profile = None
        if args.profile:
            chosen = Variant.parse(args.profile, args.micro)
            cluster.run(set_variant, chosen.keep, chosen.head, chosen.micro)
            cluster.run(start_profiler)
            cluster.run(timed_update, rows)
            profile = cluster.run(stop_profiler, 30)[0]
    figures = summarize(calls, heads, variants, args, _param_count(model_dir))
    figures.update(skipped=skipped, profile=profile)
    report(figures, args)
    write_result(args.json, args.label, figures, args)


def summarize(calls, heads, variants, args, n_params: int) -> dict:
    tokens = args.prompts * args.group * (args.prompt_len + args.response_len)
    out: dict = {"n_params": n_params, "tokens_per_update": tokens, "variants": {}}
    first = timed([c["update"] for c in calls[variants[0].name]], args.warmup)
    for v in variants:
        seconds = timed([c["update"] for c in calls[v.name]], args.warmup)
        s = spread(seconds)
        out["variants"][v.name] = {
            "update": s, "update_s": s["median"],
            "sync": spread(timed([c["sync"] for c in calls[v.name]], args.warmup)),
            "update_tokens_per_s": tokens / s["median"],
            "mfu_update": 6 * n_params * tokens / s["median"] / PEAK_BF16_FLOPS,
            "peak_gib": max(c["peak_gib"] for c in calls[v.name]),
            "head": heads[v.name], f"over {variants[0].name}": paired_ratio(seconds, first),
        }
    return out


def report(figures: dict, args) -> None:
    print(f"rlkit update levers: {args.shape}, {args.prompts}x{args.group} rows of {args.prompt_len}+"
          f"{args.response_len} tokens, {args.warmup} warm-up + {args.steps} timed rounds; "
          f"settings {args.set or 'default'}")
    for name, f in figures["variants"].items():
        ratio = next(v for k, v in f.items() if k.startswith("over "))
        print(f"  {name:<22} update {describe(f['update'])}; {f['update_tokens_per_s']:.0f} tokens/s, MFU "
              f"{f['mfu_update']:.1%}, peak {f['peak_gib']:.1f} GiB, head {f['head']}; / first {describe_ratio(ratio)}")
    if figures["skipped"]:
        print(f"  skipped (the estimate says they do not fit): {figures['skipped']}")
    if figures["profile"]:
        print(f"profile of one update ({args.profile}): top operators by self device time")
        print(figures["profile"]["ops"])
        print("the same by input shapes:")
        print(figures["profile"]["shapes"])


if __name__ == "__main__":
    main()
