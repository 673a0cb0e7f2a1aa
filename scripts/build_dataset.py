"""Write the small shipped dataset of the bundled addition task, offline: chat prompts and reference answers.

Each row is ``{"prompt": [{"role": "user", "content": "17+25="}], "answer": "42"}``, the format
verl and TRL users bring (a message list in the prompt column, the reference in its own column,
which reaches reward functions as ``answer=``). The train and val splits hold distinct
operand pairs, drawn reproducibly from the seed.

    python scripts/build_dataset.py --out rlkit/data/examples/addition --seed 0
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlkit.data.tasks import AdditionTask


def rows(pairs: list[tuple[int, int]]) -> list[dict[str, object]]:
    """One chat-prompt row per operand pair."""
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a, b in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rlkit/data/examples/addition"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=256, help="training rows")
    parser.add_argument("--val", type=int, default=64, help="validation rows")
    args = parser.parse_args()
    top = AdditionTask().max_operand
    pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
    random.Random(args.seed).shuffle(pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    splits = {"train": pairs[: args.train], "val": pairs[args.train : args.train + args.val]}
    for name, chosen in splits.items():
        path = args.out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows(chosen)), path)
        print(f"{path}: {len(chosen)} rows, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
