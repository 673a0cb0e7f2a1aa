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


def estimate_only(tmp_path: Path, mib: str | None, *args: str) -> str:
    """bench/grpo_step.py --estimate-only's output with an nvidia-smi on PATH listing one card of ``mib`` MiB (None:
    no nvidia-smi)."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if mib is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {mib}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    bench = Path(__file__).resolve().parents[1] / "bench"
    done = subprocess.run([sys.executable, "grpo_step.py", "--estimate-only", *args], cwd=bench, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return done.stdout + done.stderr


def test_the_estimate_only_run_reads_the_card_s_memory_not_an_h200_s(tmp_path):
    """The H100 records' estimates were checked against 139.8 GiB, an H200's (the flag's old default)."""
    assert "on a 79.6 GiB device" in estimate_only(tmp_path, "81559")  # an H100 80GB HBM3
    assert "on a 40.0 GiB device" in estimate_only(tmp_path / "given", "81559", "--device-memory-gib", "40")
    missing = estimate_only(tmp_path / "none", None)
    assert "no GPU visible (nvidia-smi); give the device's --device-memory-gib" in missing
