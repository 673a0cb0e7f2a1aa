"""Phases that complete or leave the trainer as it was, on the controller.

A phase that changes the models (an update: optimizer steps on the ranks, then the weight sync into the
rollout engine) runs with the kernel's Stop (KeyboardInterrupt) held until it is over: the update completes,
is counted, and only then is the interrupt raised. A second Stop abandons it at once. Whatever ends such a
phase early, the trainer asks its roles whether their weights moved (optimizer steps begun, on any rank); if
they did, the trainer is marked as needing a resume and refuses every later phase (:class:`NeedsResume`)
rather than going on from half-stepped weights or a stale engine. If they did not, nothing changed and the
phase can be run again.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)


class NeedsResume(RuntimeError):
    """The trainer's models changed part-way through a phase that did not complete: it refuses to go on."""


@contextmanager
def interrupts_held(what: str) -> Iterator[None]:
    """On the main thread: a KeyboardInterrupt (Stop, Ctrl-C) that comes inside the block is raised when the block
    ends; a second one is raised at once. Elsewhere (a background thread), or where SIGINT is not turned into
    KeyboardInterrupt (ignored, as in a background job), the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield
        return
    held: list[bool] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(True)
        logger.warning("Stop: %s finishes first, so that the models and the rollout engine change together; "
                       "Stop again to abandon it (the trainer then needs a resume)", what)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        interrupt = KeyboardInterrupt()
        interrupt.add_note(f"rlkit: {what} completed before the interrupt was raised (and was counted).")
        raise interrupt
