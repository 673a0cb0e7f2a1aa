"""bench/collect.py names records whose engines slept differently (their sync seconds do not compare)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from collect import sleep_states  # noqa: E402


def record(label: str, awake: str | None, shape: str = "0.5b") -> dict:
    state = {} if awake is None else {"awake_through_last_update": awake}
    return {"label": label, "args": {"shape": shape, "response_len": 256, "prompts": 64},
            "figures": {"engine_state": state}}


def test_records_of_one_workload_with_the_engine_awake_and_asleep_are_named():
    lines = sleep_states([record("rlkit-a", "True"), record("rlkit-b", "False"), record("trl-hf", None)])
    assert lines[:2] == ["  rlkit-a: engine awake through the update", "  rlkit-b: engine asleep through the update"]
    assert len(lines) == 3 and "warning: ('0.5b', 'fixed', 256, 64)" in lines[2] and "do not compare" in lines[2]


def test_the_same_state_or_different_workloads_raise_no_warning():
    same = sleep_states([record("rlkit-a", "True"), record("rlkit-b", "True")])
    apart = sleep_states([record("rlkit-a", "True"), record("rlkit-b", "False", shape="1.5b")])
    assert not any("warning" in line for line in same + apart) and len(same) == len(apart) == 2
