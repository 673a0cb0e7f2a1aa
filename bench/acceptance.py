"""The GPU acceptance matrix's runner (issue 43): named items, each in its own process under a timeout, recorded one
by one into one JSON file (pass/fail, not figures).

    python bench/acceptance.py --out OUT/acceptance.json [--budget 270] [--device cuda] [--raw DIR] NAME ...
    python bench/acceptance.py --list                     # the items, their estimates, whether they run on a CPU
    python bench/acceptance.py --device cpu --out /tmp/acc.json --shape tiny grpo-hf dpo   # a CPU try

Each item runs as ``python bench/acceptance_items.py NAME ...`` in a session of its own, so that a crash, a hang or
a leaked process group of one never stops the next: past its timeout (twice its estimate plus a minute, never past
the call's budget) its group gets SIGTERM, then SIGKILL. An item whose estimate the rest of the budget cannot cover
is recorded as not run. The record, rewritten atomically after every item, is::

    {"commit": ..., "device": ..., "device_memory_gib": ..., "items": [
        {"name": ..., "passed": true|false, "seconds": ..., "detail": ..., "ran": true|false}, ...]}

An item already in the file is replaced by its new result, unless that one was not run (a call re-run continues the
same record). The device
and its memory are read from ``nvidia-smi`` (this process never touches CUDA, so it never holds GPU memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ITEMS_SCRIPT = Path(__file__).with_name("acceptance_items.py")
KILL_WAIT_S = 10.0
"""How long an item's process group has to exit after SIGTERM before SIGKILL."""
DETAIL_LINES = 15
"""Lines of a failed item's output kept in its detail."""
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*$", re.MULTILINE)
"""A raised exception's last traceback line, e.g. "KeyError: 'model.layers.0.self_attn.q_proj.weight'"."""


def read_device(device: str) -> tuple[str, float | None]:
    """The card's name and memory in GiB from nvidia-smi (device "cuda"), else ("cpu", None)."""
    if device == "cpu":
        return "cpu", None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    name, mib = out.strip().splitlines()[0].rsplit(",", 1)
    return name.strip(), round(float(mib) / 1024, 1)


def load_record(path: Path, commit: str | None, device: str, memory_gib: float | None) -> dict:
    """The record at ``path`` (its items kept) under this run's commit and device, or a new one; an unreadable one
    is moved aside to ``<path>.unreadable`` (and said so), never silently overwritten."""
    items = []
    if path.is_file():
        try:
            items = json.loads(path.read_text())["items"]
            assert isinstance(items, list) and all(isinstance(i, dict) and "name" in i for i in items)
        except (ValueError, KeyError, TypeError, AssertionError):
            aside = path.with_name(path.name + ".unreadable")
            os.replace(path, aside)
            print(f"acceptance: {path} is not a record; moved to {aside}, starting a new one", flush=True)
            items = []
    return {"commit": commit, "device": device, "device_memory_gib": memory_gib, "items": items}


def record_item(path: Path, record: dict, result: dict) -> None:
    """Put ``result`` into ``record`` and rewrite ``path`` atomically. It replaces an item of its name, unless it was
    not run and that one ran (a re-run call out of budget keeps the earlier verdict)."""
    earlier = [i for i in record["items"] if i["name"] == result["name"]]
    if earlier and earlier[0].get("ran") and not result["ran"]:
        return
    record["items"] = [i for i in record["items"] if i["name"] != result["name"]] + [result]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        json.dump(record, f, indent=1, default=str)
    os.chmod(f.name, 0o644)  # a temporary file's 0600 otherwise
    os.replace(f.name, path)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the item's process group, SIGKILL it after :data:`KILL_WAIT_S`."""
    for sig, wait in ((signal.SIGTERM, KILL_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_verdict(path: Path) -> dict | None:
    """An item's ``{"passed": bool, "detail": str}``, or None where it wrote none or something else."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(verdict, dict):
        return None
    return verdict if isinstance(verdict.get("passed"), bool) and isinstance(verdict.get("detail"), str) else None


def run_item(name: str, command: list[str], timeout_s: float) -> dict:
    """Run one item's command in its own session; its verdict is the JSON it writes to the file named by the
    ``--result`` argument appended here (none: failed, with the exit status and the output's last lines)."""
    with tempfile.TemporaryDirectory() as scratch:
        result_path, log_path = Path(scratch, "result.json"), Path(scratch, "output.log")
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*command, "--result", str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                code: int | None = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
                stop_group(proc)
        seconds = round(time.monotonic() - start, 1)
        output = log_path.read_text(errors="replace")
        verdict = read_verdict(result_path)
    sys.stdout.write(output)
    tail = "\n".join(output.strip().splitlines()[-DETAIL_LINES:])
    if code is None:
        passed, detail = False, f"timed out after {timeout_s:.0f} s and was stopped; output ends:\n{tail}"
    elif verdict is None:
        errors = [m.group(0) for m in ERROR_LINE.finditer(output)]
        raised = f": {errors[-1]}" if errors else ""
        passed, detail = False, f"exit status {code} without a verdict{raised}; output ends:\n{tail}"
    else:
        passed, detail = verdict["passed"] and code == 0, verdict["detail"]
        if code != 0:
            detail = f"exit status {code} after its verdict: {detail}"
    return {"name": name, "passed": passed, "seconds": seconds, "detail": detail, "ran": True}


def not_run(name: str, why: str) -> dict:
    return {"name": name, "passed": False, "seconds": 0.0, "detail": f"not run: {why}", "ran": False}


def commit() -> str | None:
    """The code's commit: $RLKIT_COMMIT (bench/gpu_session.sh sets it from the staged wheels' COMMIT, the device
    copy's git metadata being stale), else git's."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                               cwd=Path(__file__).parent, check=False)  # fmt: skip
    return os.environ.get("RLKIT_COMMIT") or described.stdout.strip() or None


def run_items(names: list[str], items: dict, out: Path, budget: float, device: str,
              command: Callable[[str], list[str]], slow: float = 1.0) -> dict:  # fmt: skip
    """Run ``names`` in order under ``budget`` seconds, each ``command(name)`` with its timeout (``slow`` x twice
    its ``estimate_s`` plus a minute), recording each into ``out``; returns the record."""
    card, memory_gib = read_device(device)
    record = load_record(out, commit(), card, memory_gib)
    start = time.monotonic()
    for name in names:
        item, used = items[name], time.monotonic() - start
        left = budget - used
        print(f"=== {name} (estimate {item.estimate_s} s, at {used:.0f} s of {budget:.0f})", flush=True)
        if device == "cpu" and not item.cpu:
            result = not_run(name, "needs a GPU")
        elif item.estimate_s > left:
            result = not_run(name, f"needs ~{item.estimate_s} s, {left:.0f} s of the call's budget left")
        else:
            result = run_item(name, command(name), min(slow * (2 * item.estimate_s + 60), left))
        record_item(out, record, result)
        verdict = "passed" if result["passed"] else "FAILED"
        print(f"=== {name}: {verdict} ({result['seconds']} s) {result['detail']}", flush=True)
    return record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="items to run, in order")
    parser.add_argument("--list", action="store_true", help="print the items and their estimates")
    parser.add_argument("--out", type=Path, help="the acceptance record (created or continued)")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for all the named items")
    parser.add_argument("--slow", type=float, default=1.0, help="scale the items' timeouts (a loaded CPU: 5)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()), help="where models are built")
    parser.add_argument("--raw", type=Path, help="where items write their bench records (bench/results.py)")
    parser.add_argument("--shape", default="0.5b", help="the bench shape of the training items (tiny on a CPU)")
    args = parser.parse_args()
    if not args.list and (args.out is None or not args.names):
        parser.error("give --out and at least one item name (or --list)")
    return args


def main() -> None:
    from acceptance_items import ITEMS

    args = parse_args()
    if args.list:
        for name, item in ITEMS.items():
            print(f"{name:<28}{item.estimate_s:>5} s  {'cpu+gpu' if item.cpu else 'gpu':<8}{item.what}")
        return
    unknown = [n for n in args.names if n not in ITEMS]
    if unknown:
        sys.exit(f"unknown item(s) {unknown}: see --list")
    extra = ["--device", args.device, "--root", str(args.root), "--shape", args.shape]
    extra += ["--raw", str(args.raw)] if args.raw else []
    record = run_items(args.names, ITEMS, args.out, args.budget, args.device,
                       lambda name: [sys.executable, str(ITEMS_SCRIPT), name, *extra], args.slow)  # fmt: skip
    mine = [i for i in record["items"] if i["name"] in args.names]
    failed = [i["name"] for i in mine if i["ran"] and not i["passed"]]
    skipped = [i["name"] for i in mine if not i["ran"]]
    print(f"acceptance: {len(mine) - len(failed) - len(skipped)} of {len(mine)} passed; failed: {failed}; "
          f"not run: {skipped}")  # fmt: skip


if __name__ == "__main__":
    main()
