"""bench/acceptance.py's runner on fake items (one passes, one fails, one raises, one hangs with a grandchild that
ignores SIGTERM, one the budget cannot cover): every item is recorded, in order, into one JSON file rewritten
atomically after each; a crash or a hang never stops the next item; the card's memory is read from nvidia-smi;
and bench/acceptance_items.py's estimate limits at their boundaries."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import acceptance  # noqa: E402
from acceptance_items import JUDGED_GIB, UNDER, estimate_problems  # noqa: E402

VERDICT = "import json, sys; json.dump({{'passed': {passed}, 'detail': {detail!r}}}, open(sys.argv[-1], 'w'))"
SCRIPTS = {
    "passes": VERDICT.format(passed=True, detail="ok"),
    "fails": VERDICT.format(passed=False, detail="phase update under-predicted"),
    "raises": "raise RuntimeError('planted fault')",
    "garbage": "import sys; open(sys.argv[-1], 'w').write('{\"passed\": \"yes\"')",
    "hangs": textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", deaf])
        open(sys.argv[1], "w").write(str(child.pid))
        print("hanging now", flush=True)
        time.sleep(600)
    """),
}
ITEMS = {name: SimpleNamespace(estimate_s=1, cpu=True) for name in SCRIPTS}
ITEMS["too-long"] = SimpleNamespace(estimate_s=10_000, cpu=True)
ITEMS["gpu-only"] = SimpleNamespace(estimate_s=1, cpu=False)


@pytest.fixture
def run(tmp_path, monkeypatch):
    """run(names, **kw) -> the record: the fake items through acceptance.run_items (timeouts of ~1.2 s)."""
    monkeypatch.setattr(acceptance, "KILL_WAIT_S", 1.0)
    pid_file = tmp_path / "grandchild.pid"

    def command(name: str) -> list[str]:
        return [sys.executable, "-c", SCRIPTS[name], str(pid_file)]

    def run(names, out=tmp_path / "records" / "acceptance.json", budget=120.0, device="cpu"):
        return acceptance.run_items(names, ITEMS, out, budget, device, command, slow=0.02)

    run.out, run.pid_file = tmp_path / "records" / "acceptance.json", pid_file
    return run


@pytest.mark.timeout(120)
def test_every_item_is_recorded_and_a_crash_or_hang_never_stops_the_next(run):
    start = time.monotonic()
    record = run(["passes", "raises", "hangs", "fails", "garbage", "too-long", "gpu-only", "passes"])
    assert time.monotonic() - start < 60
    on_disk = json.loads(run.out.read_text())
    assert on_disk == json.loads(json.dumps(record, default=str))
    assert set(on_disk) == {"commit", "device", "device_memory_gib", "items"}
    assert on_disk["device"] == "cpu" and on_disk["device_memory_gib"] is None
    items = {i["name"]: i for i in on_disk["items"]}
    # "passes" ran twice: one entry, the last; the others in the order they ran
    assert [i["name"] for i in on_disk["items"]] == ["raises", "hangs", "fails", "garbage", "too-long", "gpu-only",
                                                     "passes"]  # fmt: skip
    assert all(set(i) == {"name", "passed", "seconds", "detail", "ran"} for i in on_disk["items"])
    assert items["passes"] == {**items["passes"], "passed": True, "detail": "ok", "ran": True}
    assert items["fails"]["passed"] is False and items["fails"]["detail"] == "phase update under-predicted"
    raised = items["raises"]
    assert not raised["passed"] and raised["ran"]
    assert raised["detail"].startswith("exit status 1 without a verdict: RuntimeError: planted fault; output ends:")
    assert "Traceback" in raised["detail"]
    assert items["garbage"]["detail"].startswith("exit status 0 without a verdict; output ends:")
    hung = items["hangs"]
    assert not hung["passed"] and hung["detail"].startswith("timed out after 1 s and was stopped")
    assert "hanging now" in hung["detail"] and hung["seconds"] < 10
    grandchild = int(run.pid_file.read_text())  # it ignored SIGTERM: the group's SIGKILL took it
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert items["too-long"] == {"name": "too-long", "passed": False, "seconds": 0.0, "ran": False,
                                 "detail": items["too-long"]["detail"]}  # fmt: skip
    assert items["too-long"]["detail"].startswith("not run: needs ~10000 s")
    assert items["gpu-only"]["detail"] == "not run: needs a GPU" and not items["gpu-only"]["ran"]
    assert sorted(p.name for p in run.out.parent.iterdir()) == ["acceptance.json"]  # no temporary files left
    assert stat.S_IMODE(run.out.stat().st_mode) == 0o644


def test_a_later_call_continues_the_record_and_replaces_re_run_items(run):
    run(["fails", "passes"])
    record = run(["fails"])
    assert [(i["name"], i["passed"]) for i in record["items"]] == [("passes", True), ("fails", False)]
    assert json.loads(run.out.read_text())["items"] == record["items"]


@pytest.mark.parametrize("text", ['{"items": [{"name": "passes"', "[]", '{"items": 3}', '{"items": [7]}'])
def test_an_unreadable_record_is_moved_aside_not_lost(run, text):
    run.out.parent.mkdir(parents=True)
    run.out.write_text(text)
    record = run(["passes"])
    assert [i["name"] for i in record["items"]] == ["passes"]
    assert run.out.with_name("acceptance.json.unreadable").read_text() == text


def test_an_item_the_budget_cannot_cover_keeps_the_verdict_of_its_earlier_run(run):
    run(["passes", "fails"])
    record = run(["passes", "fails"], budget=0.5)  # estimates of 1 s: neither runs
    assert [(i["name"], i["passed"], i["ran"]) for i in record["items"]] == [("passes", True, True),
                                                                             ("fails", False, True)]  # fmt: skip
    assert record["items"][1]["detail"] == "phase update under-predicted"


def test_the_cards_name_and_memory_are_read_from_nvidia_smi(tmp_path, monkeypatch, run):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "NVIDIA H100 80GB HBM3, 81559"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert acceptance.read_device("cuda") == ("NVIDIA H100 80GB HBM3", 79.6)  # 81559 MiB / 1024
    assert "--query-gpu=name,memory.total" in (fake.parent / "args").read_text()
    record = run(["passes"], device="cuda")
    assert (record["device"], record["device_memory_gib"]) == ("NVIDIA H100 80GB HBM3", 79.6)


def test_the_commit_is_the_staged_one_where_given(monkeypatch):
    monkeypatch.setenv("RLKIT_COMMIT", "abc1234")
    assert acceptance.commit() == "abc1234"


@pytest.mark.parametrize(
    ("ratio", "named"),
    [(1.0, False), (1.049, False), (1.051, True), (1.2, True), (0.86, False), (0.851, False), (0.849, True)],
)
def test_a_phase_fails_under_predicted_by_more_than_5_percent_or_off_by_more_than_the_tolerance(ratio, named):
    rows = [{"phase": "update", "predicted_gib": 10.0, "measured_gib": 10.0 * ratio, "measured/predicted": ratio}]
    problems = estimate_problems(rows, 0.15)
    assert bool(problems) is named, problems
    assert UNDER == 0.05
    if named:
        assert problems[0].startswith("update measured") and f"({ratio:.3f};" in problems[0]


def test_phases_under_a_gib_are_reported_not_judged():
    rows = [{"phase": "generate", "predicted_gib": 0.01, "measured_gib": 0.03, "measured/predicted": 3.0},
            {"phase": "update", "predicted_gib": 0.9, "measured_gib": 1.2, "measured/predicted": 1.333}]  # fmt: skip
    assert JUDGED_GIB == 1.0
    assert [p.split()[0] for p in estimate_problems(rows, 0.15)] == ["update"]


def test_the_plan_schedules_every_item_once_within_each_calls_budget():
    from acceptance_items import ITEMS

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    plan = subprocess.run(["bash", str(root / "bench" / "acceptance.sh"), "plan"], capture_output=True, text=True,
                          env=env, check=True, timeout=60).stdout  # fmt: skip
    rows = [line.split() for line in plan.splitlines() if line.startswith("  a")]
    scheduled = [name for _, name, _, _ in rows if name in ITEMS]
    assert sorted(scheduled) == sorted(ITEMS), plan
    per_call: dict[str, int] = {}
    for call, _, seconds, _ in rows:
        per_call[call] = per_call.get(call, 0) + int(seconds)
    assert list(per_call) == [f"a{i}" for i in range(1, 9)] and max(per_call.values()) <= 270, per_call
    assert "over the 270 s budget" not in plan
