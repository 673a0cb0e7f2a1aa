"""The memory estimate of today's code against the peaks a GPU record measured: no GPU needed.

    python bench/estimate_replay.py bench/results/2026-12-03-h200/*.json [--within 0.15] [--json out.json]

Each record of ``bench/grpo_step.py`` keeps its run's config, its arguments and, per phase, the peak that
``torch.cuda.max_memory_allocated`` read (``figures.estimate_vs_measured``). This rebuilds the estimate for that
run as grpo_step.py does and prints, per phase, the measured peak, the prediction the record was made with and
today's. ``--within F``: exit 1 unless every phase of every record is within F of today's prediction (the
test suite runs this on the records whose code path today's estimate models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
from grpo_step import memory_estimate

import rlkit
from rlkit.diagnostics.estimate import MARK_PHASES

MARK_OF = {phase: mark for mark, phase in reversed(MARK_PHASES.items())}
"""A memory mark that measures each estimate phase (the first one of MARK_PHASES)."""


def replay(path: Path) -> list[dict[str, object]]:
    """One row per measured phase of the record at ``path``: measured, then and now (GiB), and the ratios."""
    record = json.loads(path.read_text())
    # records before 2026-12-04 name no host memory: the device phases compared here do not read it
    figures, args = record["figures"], argparse.Namespace(**{"host_memory_gib": 0.0, **record["args"]})
    config = rlkit.GRPOConfig.from_dict({**figures["config"], "model": "tiny"})  # the shape comes from args.shape
    then = {row["phase"]: row for row in figures["estimate_vs_measured"]}
    marks = pd.DataFrame({"rank": 0, "phase": [MARK_OF[p] for p in then],
                          "peak_mb": [row["measured_gib"] * 1024 for row in then.values()]})
    now = memory_estimate(config, args, args.device_memory_gib).compare_marks(marks).to_dict("records")
    return [{"record": f"{path.parent.name}/{path.name}", "commit": record["env"].get("commit"), **row,
             "predicted_then_gib": then[row["phase"]]["predicted_gib"],
             "ratio_then": then[row["phase"]]["measured/predicted"]} for row in now]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--within", type=float, help="exit 1 unless every measured/predicted is within this of 1")
    parser.add_argument("--json", type=Path)
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
    off = [r for r in rows if args.within is not None and abs(r["measured/predicted"] - 1) > args.within]
    if off:
        print(f"{len(off)} phase(s) off by more than {args.within:.1%}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
