"""Join one session's bench records (``bench/results.py``) into one file, peers side by side, and print the table.

    python bench/collect.py OUT.json RECORD.json ... [--title TEXT]

Each row is one record's per-step figures; each ratio is an rlkit record's step (and generation) over a
peer's (TRL, verl, bare vLLM) of the same shape and lengths, so ratios only ever compare runs of one session.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("step_s", "generate_s", "update_s", "sync_s", "engine_sleep_s", "rest_s", "update_tokens_per_s",
           "train_tokens_per_s", "mfu_update", "peak_gib_max_rank", "peak_gib")
PEERS = ("trl", "verl", "bare")


def workload(record: dict) -> tuple:
    args = record["args"]
    return args.get("shape"), args.get("lengths", "fixed"), args.get("response_len"), args.get("prompts")


def ratios(records: list[dict]) -> dict[str, float]:
    """``"rlkit-label / peer-label"``: step over step (generation over generation for bare vLLM)."""
    out = {}
    ours = [r for r in records if not r["label"].startswith(PEERS)]
    for peer in (r for r in records if r["label"].startswith(PEERS)):
        for mine in (r for r in ours if workload(r) == workload(peer)):
            key = "generate_s" if peer["label"].startswith("bare") else "step_s"
            a, b = mine["figures"].get(key), peer["figures"].get(key)
            if a and b:
                out[f"{mine['label']} / {peer['label']} ({key})"] = a / b
    for mine in ours:
        if "generate_over_bare" in mine["figures"]:
            out[f"{mine['label']} / its bare vLLM (generate_s)"] = mine["figures"]["generate_over_bare"]
    return out


def table(records: list[dict]) -> str:
    head = "| run | workload | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in records:
        cells = [r["figures"].get(c) for c in COLUMNS]
        text = ["" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells]
        lines.append(f"| {r['label']} | {workload(r)} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in args.records if p.is_file()]
    joined = {"title": args.title, "env": records[0]["env"] if records else {}, "ratios": ratios(records),
              "table": table(records), "records": records}
    args.out.write_text(json.dumps(joined, indent=1, default=str))
    print(joined["table"])
    for name, value in joined["ratios"].items():
        print(f"  {name}: {value:.3f}")


if __name__ == "__main__":
    main()
