"""Running a turn's tool calls and environment steps at once, each with a timeout.

Every call of a turn, across all the rank's live trajectories, starts at the same time on a thread of its
own, so a turn costs its slowest call, not the sum; one slow or hung call does not hold the others. A call
still running at the timeout is reported as timed out and abandoned: Python cannot stop a thread, so it
runs on in the background (a daemon thread: it does not keep the process alive) and its result is dropped;
make long-running tools check their own deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """What one call did: its value, or the exception it raised, or that it timed out."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


def run_all(jobs: Sequence[Callable[[], Any]], timeout: float) -> list[Outcome]:
    """Run ``jobs`` concurrently (a thread each) and wait at most ``timeout`` seconds; one Outcome per job, in order."""
    outcomes: list[Outcome | None] = [None] * len(jobs)
    threads = [
        threading.Thread(target=_run, args=(job, outcomes, i), daemon=True, name=f"rlkit-call-{i}")
        for i, job in enumerate(jobs)
    ]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [Outcome(timed_out=True, seconds=timeout) if o is None else o for o in outcomes]


def _run(job: Callable[[], Any], outcomes: list[Outcome | None], index: int) -> None:
    start = time.perf_counter()
    try:
        value = job()
    except BaseException as exc:  # noqa: BLE001 - the call's failure is its outcome, reported by name
        outcomes[index] = Outcome(error=exc, seconds=time.perf_counter() - start)
    else:
        outcomes[index] = Outcome(value=value, seconds=time.perf_counter() - start)
