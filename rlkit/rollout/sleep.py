"""When a colocated engine should release its device memory while the actor trains (``rollout.sleep``)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

AWAKE_HEADROOM = 0.1
"""Fraction of the device's memory that must stay free, with the engine awake and the trainer at its last
update's high-water mark, for "auto" to keep the engine awake (slack for updates that need a little more)."""


class SleepPolicy:
    """Decides at each rollout whether the engine sleeps until the next weight sync.

    "always" and "never" are what they say. "auto" weighs what the update needs against the room the awake engine
    leaves: before the first update, the memory estimate's figure (:meth:`expect`; without one it sleeps until it
    has measured an update); at each sync after an update, the trainer process's reserved device memory (the
    caching allocator keeps the update's blocks until the engine wakes) is what the update needed. At each rollout,
    the engine stays awake when ``free - (need - held) >= AWAKE_HEADROOM * total``: the device's free memory
    now, with the engine awake, covers what the trainer will take back beyond what it holds, with room to
    spare. Measuring goes on while awake (the allocator cache then only grows), so a need that grows past the
    room puts the engine back to sleep.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.need: int | None = None
        """Bytes the trainer's process holds at its update's peak: measured at the end of the last update, or
        before one the estimate's (:meth:`expect`); None when neither is known."""
        self.measured = False
        self.awake_last = False

    def expect(self, need: int) -> None:
        """Before the first update: the memory estimate's bytes of the trainer's process at the update's peak
        (``MemoryEstimate.trainer_bytes``), so that "auto" can keep the engine awake from the first step."""
        if not self.measured:
            self.need = need

    def record_update(self, reserved: int) -> None:
        """At a weight sync after an update (before the engine wakes): the trainer process's reserved bytes,
        what that update needed (it replaces the estimate's). A sync with no update before it (a resume) is not
        one to record."""
        self.need = reserved if not self.measured or self.need is None else max(self.need, reserved)
        self.measured = True

    def should_sleep(self, *, free: int, held: int, total: int) -> bool:
        """At a rollout with the engine awake: ``free`` device bytes, ``held`` reserved by the trainer's process
        now, ``total`` the device's size."""
        if self.mode != "auto":
            return self.mode == "always"
        stay = self.need is not None and free - max(0, self.need - held) >= AWAKE_HEADROOM * total
        if stay != self.awake_last:
            gib = 2**30
            logger.info(
                "vLLM engine %s: %.1f GiB free with it awake, the trainer needs %.1f GiB more at its last update, "
                "%.0f%% of %.1f GiB kept spare (rollout.sleep='auto')",
                "stays awake" if stay else "sleeps again",
                free / gib,
                max(0, (self.need or 0) - held) / gib,
                100 * AWAKE_HEADROOM,
                total / gib,
            )
        self.awake_last = stay
        return not stay
