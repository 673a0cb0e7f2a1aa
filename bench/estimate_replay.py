"""The memory estimate of today's code against the peaks a GPU record measured: no GPU needed.

    python bench/estimate_replay.py bench/results/2026-12-03-h200/*.json [--within 0.15] [--under 0.05] [--json F]

A record of ``bench/grpo_step.py`` or of an item of ``bench/acceptance_items.py`` (one file, or bench/collect.py's
file of a call's records) keeps its run's config, its arguments and, per phase, the peak that
``torch.cuda.max_memory_allocated`` read (``figures.estimate_vs_measured``). This rebuilds the estimate for that
run as the bench did and prints, per phase, the measured peak, the prediction the record was made with and today's.
A record of ``bench/head_memory_probe.py`` is replayed through the fused head's term alone
(:func:`rlkit.diagnostics.head_memory.fused_head_bytes`), each case's scoring and update. ``--within F``: exit 1
unless every phase of every record is within F of today's prediction; ``--under U``: exit 1 if a measured peak
exceeds today's prediction by more than U (the side that runs out of memory). The test suite runs this on the
records whose code path today's estimate models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
from grpo_step import memory_estimate
from head_memory_probe import VOCAB

import rlkit
from rlkit.diagnostics.estimate import MARK_PHASES, TOLERANCE
from rlkit.diagnostics.head_memory import fused_head_bytes

MARK_OF = {phase: mark for mark, phase in reversed(MARK_PHASES.items())}
"""A memory mark that measures each estimate phase (the first one of MARK_PHASES)."""


def replay(path: Path) -> list[dict[str, object]]:
    """One row per measured phase of each record in the file at ``path``: measured, then and now (GiB), the ratios."""
    found = json.loads(path.read_text())
    rows = []
    for record in found.get("records", [found]):  # bench/collect.py's file of a call holds several
        label = f"{path.parent.name}/{path.name}" + (f":{record['label']}" if "records" in found else "")
        rows += [{"record": label, "commit": record["env"].get("commit"), **row} for row in replay_record(record, path)]
    return rows


def replay_record(record: dict, path: Path) -> list[dict[str, object]]:
    """The rows of one record, by the bench that wrote it."""
    bench = record.get("bench")
    if bench == "head_memory_probe":
        return head_rows(record["figures"]["cases"])
    figures = record["figures"]
    config = rlkit.GRPOConfig.from_dict({**figures["config"], "model": "tiny"})  # the shape comes from the args
    if bench == "acceptance_items":
        args = acceptance_args(record, config, path)
    elif bench == "grpo_step":  # records before 2026-12-04 name no host memory: the device phases do not read it
        args = argparse.Namespace(**{"host_memory_gib": 0.0, **record["args"]})
    else:
        raise KeyError(f"estimate from bench {bench!r}")
    then = {row["phase"]: row for row in figures["estimate_vs_measured"]}
    marks = pd.DataFrame({"rank": 0, "phase": [MARK_OF[p] for p in then],
                          "peak_mb": [row["measured_gib"] * 1024 for row in then.values()]})
    now = memory_estimate(config, args, args.device_memory_gib).compare_marks(marks).to_dict("records")
    return [{**row, "predicted_then_gib": then[row["phase"]]["predicted_gib"],
             "ratio_then": then[row["phase"]]["measured/predicted"]} for row in now]


def acceptance_args(record: dict, config: rlkit.GRPOConfig, path: Path) -> argparse.Namespace:
    """grpo_step.py's arguments for an acceptance item's run: one rank, the shape, fixed lengths, and the card's
    memory from the acceptance.json beside the record."""
    if config.rollout.min_new_tokens != config.rollout.max_new_tokens:
        raise KeyError("fixed lengths (an item on its own model, or with lengths that vary)")
    device_gib = json.loads((path.parent / "acceptance.json").read_text())["device_memory_gib"]
    return argparse.Namespace(world_size=1, lengths="fixed", shape=record["args"]["shape"], host_memory_gib=0.0,
                              device_memory_gib=device_gib)  # fmt: skip


def head_rows(cases: list[dict]) -> list[dict[str, object]]:
    """The head probe's cases (bf16, Qwen2.5's vocabulary, compiled chunk math) against today's head term."""
    rows = []
    for case in cases:
        hidden, n, trained = case["hidden"], case["rows"], case["weight_trained"]
        for phase, measured in case["measured_gib"].items():
            predicted = fused_head_bytes(n, VOCAB, hidden, 2, grad=phase == "update", math="fused",
                                         weight_grad=trained) / 2**30  # fmt: skip
            ratio = measured / predicted
            rows.append({"phase": f"head {phase} h{hidden} x{n} {'trained' if trained else 'frozen'}",
                         "predicted_gib": round(predicted, 3), "measured_gib": measured,
                         "measured/predicted": round(ratio, 3), f"within {TOLERANCE:.0%}": abs(ratio - 1) <= TOLERANCE,
                         "predicted_then_gib": case["predicted_gib"][phase],
                         "ratio_then": case["measured/predicted"][phase]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--within", type=float, help="exit 1 unless every measured/predicted is within this of 1")
    parser.add_argument("--under", type=float, help="exit 1 if a measured/predicted exceeds 1 by more than this")
    parser.add_argument("--json", type=Path, help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for path in args.records:
        try:
            rows += replay(path)
        except rlkit.ConfigError as err:  # a record from an rlkit whose settings have changed since
            print(f"{path}: skipped, its config no longer loads: {str(err).splitlines()[1:]}", file=sys.stderr)
        except KeyError as err:  # a record from before grpo_step.py kept the config or the measured peaks
            print(f"{path}: skipped, the record has no {err}", file=sys.stderr)
    for row in rows:
        print(f"{row['record']:<48} {row['phase']:<15} measured {row['measured_gib']:7.2f} GiB; predicted then "
              f"{row['predicted_then_gib']:7.2f} ({row['ratio_then']:.3f}), now {row['predicted_gib']:7.2f} "
              f"({row['measured/predicted']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    ratios = [r["measured/predicted"] for r in rows]
    off = [x for x in ratios if args.within is not None and abs(x - 1) > args.within]
    under = [x for x in ratios if args.under is not None and x > 1 + args.under]
    if off or under:
        print(f"{len(off)} phase(s) off by more than {args.within}, {len(under)} under-predicted by more than "
              f"{args.under}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
