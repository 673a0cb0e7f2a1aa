"""Write the small shipped preference sets of the bundled addition task, offline and deterministically.

``dpo.parquet``: ``{"prompt": [{"role": "user", "content": "17+25="}], "chosen": [{"role": "assistant",
"content": "42"}], "rejected": [{"role": "assistant", "content": "43"}]}``, the conversational format TRL
users bring; the rejected sum is wrong by one or ten either way (a near miss the tiny model makes).
``kto.parquet``: ``{"prompt": [...], "completion": [{"role": "assistant", "content": ...}], "label": bool}``,
half right (True) and half near misses (False), alternating. The operand pairs are those of the shipped
``train.parquet`` (scripts/build_dataset.py with the same seed), so the validation split stays unseen.

    python scripts/build_preferences.py --out rlkit/data/examples/addition --seed 0
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlkit.data.tasks import AdditionTask

MISSES = (-10, -1, 1, 10)
"""How far a rejected (or undesirable) sum is from the right one."""


def near_miss(total: int, rng: random.Random) -> int:
    """A wrong, non-negative sum close to ``total``."""
    return total + rng.choice([d for d in MISSES if total + d >= 0])


def turn(role: str, content: str) -> list[dict[str, str]]:
    return [{"role": role, "content": content}]


def dpo_rows(pairs: list[tuple[int, int]], rng: random.Random) -> list[dict[str, object]]:
    """One (prompt, right sum, near miss) pair per operand pair."""
    return [
        {
            "prompt": turn("user", f"{a}+{b}="),
            "chosen": turn("assistant", str(a + b)),
            "rejected": turn("assistant", str(near_miss(a + b, rng))),
        }
        for a, b in pairs
    ]


def kto_rows(pairs: list[tuple[int, int]], rng: random.Random) -> list[dict[str, object]]:
    """One labelled completion per operand pair: the right sum (True) on even rows, a near miss (False) on odd."""
    rows: list[dict[str, object]] = []
    for i, (a, b) in enumerate(pairs):
        right = i % 2 == 0
        answer = a + b if right else near_miss(a + b, rng)
        rows.append({"prompt": turn("user", f"{a}+{b}="), "completion": turn("assistant", str(answer)), "label": right})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rlkit/data/examples/addition"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=128, help="examples per set")
    args = parser.parse_args()
    top = AdditionTask().max_operand
    pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
    random.Random(args.seed).shuffle(pairs)  # the order scripts/build_dataset.py gives the train split
    chosen = pairs[: args.rows]
    args.out.mkdir(parents=True, exist_ok=True)
    sets = {"dpo": dpo_rows(chosen, random.Random(f"{args.seed}:dpo")),
            "kto": kto_rows(chosen, random.Random(f"{args.seed}:kto"))}  # fmt: skip
    for name, rows in sets.items():
        path = args.out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"{path}: {len(rows)} rows, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
