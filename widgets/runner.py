"""Trainer steps in a background thread, so the kernel stays free while a run goes; stop between steps."""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class _Stopped(Exception):
    """Raised from fit's on_step hook to end a run between steps."""


class Runner:
    """Runs ``trainer.fit(steps)`` in one background thread at a time.

    While a run goes, only that thread calls the trainer (the trainer and cluster are not thread-safe):
    ``on_step(row)`` after each step and ``on_end(error)`` once at the end run in it, and :attr:`running`
    stays True until both returned; ``on_idle()`` follows, for widget updates only. :meth:`stop` ends
    the run after the step in progress (its checkpoint, if due, is written).
    """

    def __init__(self, trainer, *, on_step: Callable[[dict], None], on_end: Callable[[BaseException | None], None],
                 on_idle: Callable[[], None]):
        self.trainer = trainer
        self.on_step, self.on_end, self.on_idle = on_step, on_end, on_idle
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._lock.locked()

    def start(self, steps: int) -> None:
        """Begin a run of ``steps`` steps in the background and return at once."""
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a run is already going: stop it (Stop button or .stop()) or wait for it")
        self._stop.clear()
        # The caller's context travels with the thread, so ipykernel 7 routes anything it prints to the cell
        # that started it (ipykernel 6 keeps no such context; nothing changes there).
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, steps), name="rlkit-run", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the run to end after the step in progress."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run (and its on_idle) finished; False if ``timeout`` seconds passed first."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self, steps: int) -> None:
        error = None
        try:
            self.trainer.fit(steps, progress=False, on_step=self._after_step)
        except _Stopped:
            logger.info("run stopped after step %d", self.trainer.steps_done)
        except Exception as exc:  # shown by on_end; the thread must not die silently
            logger.exception("run failed at step %d", self.trainer.steps_done + 1)
            error = exc
        try:
            self.on_end(error)
        finally:
            self._lock.release()
            self.on_idle()

    def _after_step(self, row: dict) -> None:
        self.on_step(row)
        if self._stop.is_set():
            raise _Stopped


class Throttle:
    """``ready()`` is True at most once per ``interval`` seconds (the first call is always ready)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last = -math.inf

    def ready(self) -> bool:
        now = self.clock()
        if now - self._last < self.interval:
            return False
        self._last = now
        return True
