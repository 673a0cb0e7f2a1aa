"""Running a turn's tool calls and environment steps at once, each with a timeout.

Every call of a turn, across all the rank's live trajectories, starts at the same time on a thread of its
own, so a turn costs its slowest call, not the sum; one slow or hung call does not hold the others. A call
still running at the timeout is reported as timed out and abandoned: Python cannot stop a thread, so it
runs on in the background and its result is dropped (make long-running tools check their own deadline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """What one call did: its value, or the exception it raised, or that it timed out."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


def run_all(jobs: list[Callable[[], Any]], timeout: float) -> list[Outcome]:
    """Run ``jobs`` concurrently (a thread each) and wait at most ``timeout`` seconds; one Outcome per job, in order."""
    if not jobs:
        return []
    pool = ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="rlkit-call")
    try:
        futures = [pool.submit(_timed, job) for job in jobs]
        wait(futures, timeout=timeout)
        return [_outcome(f, timeout) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _timed(job: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return job(), time.perf_counter() - start


def _outcome(future: Future, timeout: float) -> Outcome:
    if not future.done():
        return Outcome(timed_out=True, seconds=timeout)
    error = future.exception()
    if error is not None:
        return Outcome(error=error)
    value, seconds = future.result()
    return Outcome(value=value, seconds=seconds)
