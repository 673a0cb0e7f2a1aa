"""Join one session's bench records (``bench/results.py``) into one file, peers side by side, and print the table and
the ratios with their spreads.

    python bench/collect.py OUT.json RECORD.json ... [--title TEXT]

Each row is one record's medians (with min-max of the timed steps); each ratio compares an rlkit record with a
peer of the same shape and lengths (TRL, verl, bare vLLM) from the same session: step over step, rlkit's update
over the peer's training part (TRL's step minus its generation; verl's update), and generation over bare vLLM.
Ratios of two runs that alternated in one process (rlkit's engine and bare vLLM, update variants) are paired:
the ratio of the medians and the range of the per-step ratios. Ratios of runs in different processes are
unpaired: the ratio of the medians, the range from min/max to max/min and the same from the quartiles.

rlkit's sync and engine-sleep seconds depend on whether its vLLM engine stayed awake through the update
(``rollout.sleep="auto"`` decides by the room left on the device): each rlkit record's state is printed, and two
records of one workload in different states are named, since their sync and sleep columns do not compare (the
0.043 s -> 0.33 s "regression" of 2026-12-03 was a bench engine taking the room, not a change in rlkit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stats import describe_ratio

COLUMNS = ("step", "generate", "update", "sync", "logprobs", "rest")
PEERS = ("trl", "verl", "bare")
TRAINING = {"trl": "rest", "verl": "update"}
"""The phase of each peer that does what rlkit's update does (the training forward, backward and optimizer step)."""


def workload(record: dict) -> tuple:
    args = record["args"]
    return args.get("shape"), args.get("lengths", "fixed"), args.get("response_len"), args.get("prompts")


def phases(record: dict) -> dict[str, dict]:
    """Phase -> spread: a record's ``phases``, or each update variant's as "update [variant]"."""
    figures = record["figures"]
    out = dict(figures.get("phases", {}))
    for name, variant in figures.get("variants", {}).items():
        out[f"update [{name}]"] = variant["update"]
    return {k.removesuffix("_s"): v for k, v in out.items()}


def unpaired(a: dict, b: dict) -> dict[str, float]:
    """median(a) / median(b) with the range min(a)/max(b) .. max(a)/min(b) and the quartiles' q1/q3 .. q3/q1."""
    if not a.get("n") or not b.get("n"):
        return {"n": 0}
    return {"ratio_of_medians": a["median"] / b["median"], "range": (a["min"] / b["max"], a["max"] / b["min"]),
            "iqr_range": (a["q1"] / b["q3"], a["q3"] / b["q1"]), "n": (a["n"], b["n"])}


def ratios(records: list[dict]) -> dict[str, dict]:
    """``"rlkit-label / peer-label (phase)"`` -> the ratio and its spread."""
    out: dict[str, dict] = {}
    ours = [r for r in records if not r["label"].startswith(PEERS)]
    for mine in ours:
        if "generate_over_bare" in mine["figures"]:
            out[f"{mine['label']} / its bare vLLM (generate, paired)"] = mine["figures"]["generate_over_bare"]
        for name, variant in mine["figures"].get("variants", {}).items():
            for key, ratio in variant.items():
                if key.startswith("over ") and name not in key:
                    out[f"{mine['label']} [{name}] / [{key.removeprefix('over ')}] (update, paired)"] = ratio
    for peer in (r for r in records if r["label"].startswith(("trl", "verl"))):
        training = TRAINING[peer["label"].split("-")[0]]
        theirs = phases(peer)
        for mine in (r for r in ours if workload(r) == workload(peer)):
            own = phases(mine)
            if "step" in own and "step" in theirs:
                out[f"{mine['label']} / {peer['label']} (step)"] = unpaired(own["step"], theirs["step"])
            for name, s in own.items():
                if name.startswith("update") and training in theirs:
                    out[f"{mine['label']} {name} / {peer['label']} {training}"] = unpaired(s, theirs[training])
    return out


def engine_awake(record: dict) -> str | None:
    """"awake" / "asleep" through the last update (rlkit's vLLM records), else None."""
    state = record["figures"].get("engine_state", {}).get("awake_through_last_update")
    return None if state is None else ("awake" if state == "True" else "asleep")


def sleep_states(records: list[dict]) -> list[str]:
    """Each rlkit record's engine state, and a warning for each workload whose records differ in it."""
    states = {r["label"]: (workload(r), engine_awake(r)) for r in records if engine_awake(r) is not None}
    lines = [f"  {label}: engine {state} through the update" for label, (_, state) in states.items()]
    for load in {w for w, _ in states.values()}:
        seen = {label: state for label, (w, state) in states.items() if w == load}
        if len(set(seen.values())) > 1:
            lines.append(f"  warning: {load}: the engine was awake in some records and asleep in others "
                         f"({seen}): their sync and engine_sleep seconds do not compare")
    return lines


def describe(ratio: dict) -> str:
    if "pairs_n" in ratio:
        return describe_ratio(ratio)
    if not ratio.get("n"):
        return "n/a"
    (lo, hi), (q1, q3) = ratio["range"], ratio["iqr_range"]
    return f"{ratio['ratio_of_medians']:.3f} (range {lo:.3f}-{hi:.3f}, from quartiles {q1:.3f}-{q3:.3f})"


def table(records: list[dict]) -> str:
    """One row per record (and per update variant): median (min-max) seconds of each phase."""
    lines = ["| run | workload | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 2)]
    for r in records:
        spreads = phases(r)
        rows = [(r["label"], spreads)]
        rows += [(f"{r['label']} [{k[8:-1]}]", {"update": v}) for k, v in spreads.items() if k.startswith("update [")]
        for label, row in rows:
            cells = [_cell(row.get(c)) for c in COLUMNS]
            lines.append(f"| {label} | {workload(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(s: dict | None) -> str:
    if not s or not s.get("n"):
        return ""
    return f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in args.records if p.is_file()]
    joined = {"title": args.title, "env": records[0]["env"] if records else {}, "ratios": ratios(records),
              "table": table(records), "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(joined, indent=1, default=str))
    print(joined["table"])
    for name, value in joined["ratios"].items():
        print(f"  {name}: {describe(value)}")
    print("\n".join(sleep_states(records)))


if __name__ == "__main__":
    main()
