"""Running a turn's tool calls and environment methods at once, each with a timeout, on one event loop.

A worker's :class:`CallRunner` owns one asyncio event loop, on a thread of its own, for every tool call and
environment method of its rollouts: an ``async def`` tool is awaited there, and an async environment keeps
what it opened in ``reset`` (a subprocess, a client, a browser page) usable in every ``step`` and in ``close``,
since they all run on the same loop. A plain (sync) function runs on a thread of its own, so a slow one holds
neither the loop nor the other calls; a turn costs its slowest call, not the sum.

A call still running at the timeout is reported as timed out: an async one is cancelled; a sync one cannot be
stopped (Python cannot stop a thread), so it runs on in the background (a daemon thread: it does not keep the
process alive) and its result is dropped; make long-running tools check their own deadline, or make them async.
An async call that ignores its cancellation is abandoned :data:`GRACE` seconds later, reported as timed out.

Whatever a call raises is that call's error, :class:`BaseException` included (a tool's ``SystemExit``,
``KeyboardInterrupt``, ``GeneratorExit``, its own ``TimeoutError`` or ``asyncio.CancelledError``): it stops
neither the loop nor the other calls. Only the run's own cancellation goes through.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

Job = Callable[[], Awaitable[Any]]
"""A call to make: a function returning the coroutine to run (see :func:`call`)."""
GRACE = 1.0
"""Seconds past its timeout after which an async call that ignores its cancellation is abandoned."""


@dataclass(frozen=True)
class Outcome:
    """What one call did: its value, or the exception it raised (its own ``TimeoutError`` too), or that it ran past
    the timeout."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.timed_out or self.error is not None

    @property
    def why(self) -> str:
        """How it failed: "timed out after <s> s", or the exception's repr."""
        return f"timed out after {self.seconds:g} s" if self.timed_out else repr(self.error)


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` from the loop: a coroutine function is awaited on it, a plain function runs on a
    thread of its own (and what it returns is awaited when it is awaitable)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    value = await _on_thread(fn, args, kwargs)
    return await value if inspect.isawaitable(value) else value


def _on_thread(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> asyncio.Future:
    """A future of the running loop settled by ``fn(*args, **kwargs)`` on a daemon thread (left to run if the
    future is cancelled: its result is dropped)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled at its timeout
            return
        future.set_result(value) if error is None else future.set_exception(error)

    def run() -> None:
        value, error = None, None
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the call's failure (SystemExit and the like too) is its outcome
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    threading.Thread(target=run, daemon=True, name=f"rlkit-call-{getattr(fn, '__name__', 'fn')}").start()
    return future


class CallRunner:
    """One event loop, on a daemon thread of its own, for the tool calls and environment methods of a worker's
    rollouts; :meth:`run_all` runs a batch of calls on it and waits for them."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rlkit-calls")
        self._thread.start()

    def run_all(self, jobs: Sequence[Job], timeout: float) -> list[Outcome]:
        """Run ``jobs`` concurrently on the loop, each within ``timeout`` seconds; one Outcome per job, in order."""
        return asyncio.run_coroutine_threadsafe(self._gather(jobs, timeout), self._loop).result()

    def close(self) -> None:
        """Stop the loop and close it (calls still running are abandoned); idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _gather(self, jobs: Sequence[Job], timeout: float) -> list[Outcome]:
        """Each job's outcome; one still running :data:`GRACE` s past the timeout (it ignored its cancellation) is
        abandoned as timed out."""
        if not jobs:
            return []
        tasks = [asyncio.ensure_future(_timed(job, timeout)) for job in jobs]
        _, running = await asyncio.wait(tasks, timeout=timeout + GRACE)
        for task in running:
            task.cancel()
        return [Outcome(timed_out=True, seconds=timeout) if task in running else task.result() for task in tasks]


async def _timed(job: Job, timeout: float) -> Outcome:
    """``job``'s outcome within ``timeout`` seconds; whatever it raises is its error, but for the cancellation of
    the task that runs it (the run's own)."""
    start = time.perf_counter()
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            value = await job()
    except TimeoutError as exc:
        if deadline.expired():
            return Outcome(timed_out=True, seconds=timeout)
        return Outcome(error=exc, seconds=time.perf_counter() - start)  # the call's own TimeoutError
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # this task is cancelled: not the call's doing
            raise
        return Outcome(error=exc, seconds=time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and the like of a call are its error, not the loop's end
        return Outcome(error=exc, seconds=time.perf_counter() - start)
    return Outcome(value=value, seconds=time.perf_counter() - start)
